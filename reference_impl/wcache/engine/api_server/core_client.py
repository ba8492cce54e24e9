"""The front process's view of its engine core (vLLM V1's EngineCoreClient): the part of ``Engine``'s
surface the HTTP layer uses, served by another process (engine/core/core_proc.py).

``pieces()`` tokenizes the prompt here, sends an ``AddRequest`` and yields text (textstream.py:
detokenizing, stop strings) from the token ids the core sends back; closing the generator, a stop
string or a client gone sends an ``AbortRequest``. One reader thread takes the core's frames and
puts each request's tokens in its queue; a request more than STREAM_BUFFER_TOKENS behind (a client
that stopped reading) is ended here (``overflow``), and the core is told to free its slot: the core's
step loop never waits for anyone. No torch in this module or anything it imports.
"""

from __future__ import annotations

import itertools
import json
import logging
import queue
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

import msgspec

from wcache.engine.core.completion import (
    STREAM_BUFFER_TOKENS,
    Completion,
    _End,
    drive,
    read_completion,
    stop_sets,
)
from wcache.engine.core.core_messages import (
    AbortRequest,
    AddRequest,
    ChannelError,
    Planned,
    Proceed,
    QueueFullError,
    Ready,
    Start,
    Status,
    StepOutputs,
    Unhealthy,
    Waiting,
    front_channel,
    prompt_scores_of,
    sampled_of,
    sampling_of,
)
from wcache.engine.worker.sampling_params import GREEDY, SamplingParams
from wcache.core.settings import to_data
from wcache.engine.core.settings import CoreSettings
from wcache.engine.core.scheduler import QueueFull
from wcache.engine.core.textstream import TextStream
from wcache.engine.api_server.front_failover import stop_core
from wcache.engine.loading import waiting as cache_wait
from wcache.core import owner_death
from wcache.core.owner_death import OwnerDeath
from wcache.engine.core.failover_policy import cause
from wcache.errors import (
    CORE_EXITED,
    CORE_FAILED,
    CORE_PROMOTED,
    STREAM_OVERFLOW,
    TEXT_WITHOUT_TOKENIZER,
)

log = logging.getLogger("wcache.engine")

STOP_WAIT_S = 90.0  # the core's engine.close() waits up to 60 s for its step, then stops the ranks
# Logged at a promoted core's first frame: when the front saw the channel close, reaped the dead core,
# had the spare, had re-added the requests in flight, and had the new core's first tokens (monotonic s).
FAILOVER_TIMELINE = "Core failover timeline: {json}"


@dataclass(frozen=True)
class CoreConfig:
    """What the HTTP layer reads of ``engine.cfg``."""

    device: str
    hf: dict = field(default_factory=dict)


def show_waiting(msg: Waiting) -> None:
    """This process's /health while the core waits for the weight cache daemon (engine/loading/waiting.py)."""
    if msg.state is None:
        cache_wait.clear()
    else:
        cache_wait.set_waiting(msg.state.get("socket"), msg.state.get("reason", ""), msg.state.get("timeout_s", 0))


def spawn_core(settings: CoreSettings) -> tuple[subprocess.Popen, socket.socket]:
    """The engine core process, told ``settings`` (no API key: it stays in the front), and this end of its channel."""
    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    # The core holds this mutex for life: the front learns of its death as it dies (core/owner_death.py)
    # rather than once the kernel has given its memory back and closed its end of the channel.
    death = OwnerDeath() if owner_death.available() else None
    extra = [death.fd] if death is not None else []
    proc = subprocess.Popen([sys.executable, "-m", "wcache.engine.core.core_proc", str(theirs.fileno()),
                             *map(str, extra)], pass_fds=(theirs.fileno(), *extra))
    theirs.close()
    if death is not None:
        death.close_fd()
    proc.owner_death = death  # watched once the core has said it holds it (its first frame: Planned)
    front_channel(mine).send(Start(to_data(settings)))
    return proc, mine


class EngineCoreClient:
    def __init__(self, proc: subprocess.Popen, sock: socket.socket, tokenizer, stop_ids: frozenset[int]):
        self.proc = proc
        self.channel = front_channel(sock)
        self.tokenizer, self.stop_ids = tokenizer, stop_ids
        self.closed = self.dead = False
        self.on_death = None  # called (on the reader thread) once the core is gone unasked
        self._ids = itertools.count(1)
        self._boxes: dict[int, queue.SimpleQueue] = {}
        # id -> (its AddRequest, the token ids handed on so far): what a promoted core resumes it from
        self._asks: dict[int, tuple[AddRequest, list[int]]] = {}
        self._lock = threading.Lock()
        # Held while a request is added or aborted, and while a promoted core takes over: a request
        # reaches the dead core or the new one, never both and never neither.
        self._swap = threading.RLock()
        self.failover = None  # front_failover.Failover with --respawn
        self.heard = time.monotonic()  # the core's last frame (its heartbeat while requests run)
        self._running = self._waiting = 0
        self._alive: float | None = None
        self.on_unhealthy = None  # called (on the reader thread) when a rank of the core died
        self._timeline: dict | None = None  # a failover's phases until the promoted core's first frame
        self._death_seen: float | None = None  # when the serving core's owner-death mutex woke us
        self.on_promoted = None  # called with the promoted core's Ready once it serves (--respawn)

    # -- start-up (the front's main thread) ------------------------------------------------------
    def planned(self) -> Planned | None:
        """The core's first word (whether this node serves HTTP); None if it exited first."""
        planned = self._first(Planned)
        if planned is not None:
            self.watch_death(self.proc)
        return planned

    def watch_death(self, proc: subprocess.Popen) -> None:
        """Once ``proc`` holds its owner-death mutex (it has sent a frame): at its death, if it still
        serves, end its channel here, so the reader sees the end at once (buffered frames first)."""
        death = getattr(proc, "owner_death", None)
        if death is None:
            return

        def died() -> None:
            with self._swap:  # not the channel of a core promoted meanwhile
                if self.closed or proc is not self.proc:
                    return
                self._death_seen = time.monotonic()
                try:
                    self.channel.sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
        death.watch(died)

    def proceed(self) -> None:
        """Let the core load (after Planned, once the port is held)."""
        self.channel.send(Proceed())

    def wait_ready(self) -> Ready | None:
        """Blocks until the core has loaded (its Ready); None if it exited first. Then the reader runs."""
        ready = self._first(Ready)
        if ready is None:
            return None
        self.ready_info = ready
        self.max_model_len, self.max_num_seqs, self.has_draft = ready.max_model_len, ready.max_num_seqs, ready.has_draft
        self.cfg = CoreConfig(ready.device, {"vocab_size": ready.vocab_size})
        self.report, self.load_format = ready.report, ready.load_format
        threading.Thread(target=self._read, args=(self.channel,), name="wcache-core-reader", daemon=True).start()
        return ready

    def _first(self, kind):
        try:
            msg = self.channel.recv()
            while isinstance(msg, Waiting):  # the core's loader waits for the daemon: /health says so
                show_waiting(msg)
                msg = self.channel.recv()
        except ChannelError as e:
            log.error("%s", e)
            msg = None
        if msg is None or not isinstance(msg, kind):
            if msg is not None:
                log.error("The engine core sent %s before %s", type(msg).__name__, kind.__name__)
            return None
        return msg

    def exit_code(self) -> int:
        """The core's exit status once it has ended (at least 1 if it ended on its own)."""
        code = self.proc.wait()
        return code if code > 0 else 1

    # -- what the HTTP layer reads ---------------------------------------------------------------
    def in_flight(self) -> int:
        with self._lock:
            return len(self._asks)

    def num_requests_running(self) -> int:
        return self._running

    def num_requests_waiting(self) -> int:
        return self._waiting

    def daemon_alive(self) -> float | None:
        return self._alive

    # -- a request's thread ----------------------------------------------------------------------
    def generate(self, prompt, max_tokens: int, sampling: SamplingParams = GREEDY, stop=(), on_text=None,
                 queued=None, skip_special_tokens: bool = True, **stopping) -> Completion:
        """As Engine.generate."""
        return drive(self.pieces(prompt, max_tokens, sampling, stop, queued, skip_special_tokens, **stopping), on_text)

    def pieces(self, prompt, max_tokens: int, sampling: SamplingParams = GREEDY, stop=(), queued=None,
               skip_special_tokens: bool = True, stop_token_ids=(), ignore_eos: bool = False,
               include_stop: bool = False):
        """As Engine.pieces: yields each new piece of final text; ``send(True)`` stops the request."""
        if isinstance(prompt, str) and self.tokenizer is None:
            raise ValueError(TEXT_WITHOUT_TOKENIZER)
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
        if self.closed or self.dead:
            raise RuntimeError("the engine is stopping")
        own_stops, stop_ids, held = stop_sets(self.stop_ids, stop_token_ids, ignore_eos)
        rid, box = next(self._ids), queue.SimpleQueue()
        add = AddRequest(rid, ids, max_tokens, sampling_of(sampling), sorted(stop_ids), sorted(held))
        with self._swap:
            with self._lock:
                if not self._asks:  # an idle core is quiet (core_engine.report_status): the heartbeat's
                    self.heard = time.monotonic()  # silence counts from the work it is given, not its last frame
                self._boxes[rid] = box
                self._asks[rid] = (add, [])
            try:
                self.channel.send(add)
            except OSError:
                if self.failover is None:  # else the core just died: the promoted one gets it
                    self._forget(rid)
                    raise RuntimeError(CORE_FAILED.format(code=self.proc.poll())) from None
        if queued is not None:
            queued()

        def get():
            item = box.get()
            if isinstance(item, QueueFull):
                raise item
            return item

        text = TextStream(self.tokenizer.stream(skip_special_tokens) if self.tokenizer else None, stop,
                          include_stop, sampling.min_tokens)
        eos = self.tokenizer.eos_token_id if self.tokenizer else None
        try:
            return (yield from read_completion(get, lambda: self._abort(rid), ids, stop_ids, own_stops, eos, text,
                                               sampling.logprobs is not None))
        finally:
            self._forget(rid)

    def _forget(self, rid: int) -> None:
        with self._lock:
            self._boxes.pop(rid, None)
            self._asks.pop(rid, None)

    def _abort(self, rid: int) -> None:
        with self._swap:
            self._forget(rid)
            if not self.dead:
                try:
                    self.channel.send(AbortRequest(rid))
                except OSError:
                    pass  # the core is gone: the reader says so

    # -- the reader thread -------------------------------------------------------------------------
    def _read(self, channel) -> None:
        try:
            while True:
                msg = channel.recv()
                if msg is None:
                    break
                self.heard = time.monotonic()
                if self._timeline is not None and isinstance(msg, StepOutputs):
                    self._log_timeline()
                if isinstance(msg, StepOutputs):
                    self._running, self._waiting = msg.running, msg.waiting
                    self._deliver(msg)
                elif isinstance(msg, Status):
                    self._running, self._waiting, self._alive = msg.running, msg.waiting, msg.daemon_alive
                elif isinstance(msg, QueueFullError):
                    with self._lock:
                        box = self._boxes.get(msg.id)
                    if box is not None:
                        box.put(QueueFull(msg.waiting, msg.limit))
                elif isinstance(msg, Unhealthy) and self.on_unhealthy is not None:
                    self.on_unhealthy()
        except ChannelError as e:
            log.error("%s", e)
        self._gone(time.monotonic())

    def _deliver(self, msg: StepOutputs) -> None:
        for o in msg.outputs:
            with self._lock:
                box, ask = self._boxes.get(o.id), self._asks.get(o.id)
            if box is None:
                continue  # aborted here already
            if o.prompt_scores is not None:
                box.put(prompt_scores_of(o.prompt_scores))
            for tok in o.tokens:
                if box.qsize() >= STREAM_BUFFER_TOKENS:  # its reader is that far behind
                    log.warning(STREAM_OVERFLOW.format(limit=STREAM_BUFFER_TOKENS))
                    self._abort(o.id)
                    box.put(_End("overflow"))
                    break
                box.put(sampled_of(tok))
                if ask is not None:
                    ask[1].append(tok.id)
            else:
                if o.finished is not None:
                    box.put(_End(o.finished, RuntimeError(o.error) if o.error else None))

    def _gone(self, closed_at: float) -> None:
        """The channel closed: a core we stopped, or one that died."""
        if self.closed:
            self.dead = True
            return
        dead = self.proc
        seen, self._death_seen = min(closed_at, self._death_seen or closed_at), None
        if self.failover is not None:
            # On the CPU the spare needs nothing the dead core still holds: it is promoted while the
            # kernel tears the dead one down, and reaped after. A GPU's memory is freed only at the
            # exit, and the spare sizes its KV cache from what is free: reap first there.
            if self.cfg.device != "cpu":
                dead.wait()
            timeline = {"dead_pid": dead.pid, "death_seen": seen, "channel_closed": closed_at}
            core = self.failover.promote(dead.pid, dead.wait)
            if core is not None:
                timeline.update(pid=core.proc.pid, spare_taken=time.monotonic())
                self._take_over(core, timeline)
                self.watch_death(core.proc)
                log.warning(CORE_PROMOTED.format(pid=core.proc.pid, dead=dead.pid, cause=cause(dead.wait()),
                                                 ms=(timeline["spare_taken"] - seen) * 1e3))
                return
        code = dead.wait()
        self.dead = True
        log.error(CORE_EXITED.format(pid=self.proc.pid, code=code))
        error = RuntimeError(CORE_FAILED.format(code=code))
        with self._lock:
            boxes, self._boxes = list(self._boxes.values()), {}
        for box in boxes:
            box.put(_End("error", error))
        if self.on_death is not None:
            self.on_death()

    def _take_over(self, core, timeline: dict) -> None:
        """The promoted core serves: every request in flight is added to it with the tokens already
        handed on (it runs them as context and goes on), and its frames are read from now on."""
        resumed = 0
        with self._swap:
            old, self.proc, self.channel = self.channel, core.proc, core.channel
            self.heard = time.monotonic()
            with self._lock:
                asks = list(self._asks.items())
            for rid, (add, got) in asks:
                if len(got) >= add.max_tokens:  # its last token came, its end did not: it is whole
                    with self._lock:
                        box = self._boxes.get(rid)
                    if box is not None:
                        box.put(_End("length"))
                    continue
                try:
                    self.channel.send(msgspec.structs.replace(add, output_token_ids=list(got)))
                    resumed += 1
                except OSError:
                    break  # this core died too: its reader promotes the next, which gets them all
            old.close()
            self._timeline = {**timeline, "resumed": resumed, "requests_sent": time.monotonic()}
            threading.Thread(target=self._read, args=(self.channel,), name="wcache-core-reader", daemon=True).start()
        self.report = core.ready.report  # what /metrics and the load's labels now describe
        if self.on_promoted is not None:
            self.on_promoted(core.ready)

    def _log_timeline(self) -> None:
        timeline, self._timeline = self._timeline, None
        timeline["first_output"] = time.monotonic()
        log.info(FAILOVER_TIMELINE.format(json=json.dumps(
            {k: round(v, 6) if isinstance(v, float) else v for k, v in timeline.items()})))

    # -- the end -----------------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the core (after the drain): it aborts what still runs, stops its ranks and exits."""
        if self.closed:
            return
        self.closed = True
        if self.failover is not None:
            self.failover.close()
        stop_core(self.channel, self.proc, STOP_WAIT_S, ask=not self.dead)
