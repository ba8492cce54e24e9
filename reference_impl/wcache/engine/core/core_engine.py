"""The engine core's work (engine/core/core_proc.py is its process): the device, the weights, the KV cache
and the scheduler (vLLM V1's EngineCore), for the front process (engine/api_server/core_client.py).

It plans the ranks (``Planned``: whether this node serves HTTP), starts the other local ranks and loads
as ``run_serve`` does, then runs the engine's own step loop (engine.py) with one change: a request's
outbox is this process's list of outputs, sent to the front as one ``StepOutputs`` frame per step by
a thread of its own, so the step loop never waits on the front, let alone on a client.
A slow reader is the front's business (core_client.py ends it past STREAM_BUFFER_TOKENS).

The front gone (its end of the channel closed) stops the core: there is nobody to answer.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time

from wcache.core.distributed import exit_after_collectives
from wcache.engine.core.completion import _End
from wcache.engine.core.core_messages import (
    AbortRequest,
    AddRequest,
    ChannelError,
    LoadInfo,
    Planned,
    Prepared,
    Proceed,
    Promote,
    QueueFullError,
    Ready,
    RequestOutput,
    Shutdown,
    Status,
    StepOutputs,
    Unhealthy,
    Waiting,
    params_of,
    prompt_scored_of,
    token_of,
)
from wcache.engine.core.engine import Engine, rank_specs
from wcache.engine.core.failover_policy import BEAT_S
from wcache.engine.worker.outputs import PromptScores
from wcache.engine.worker.runner import RankRunner
from wcache.engine.worker.sampling import Sampler
from wcache.engine.core.scheduler import ARRIVAL_WAIT_S, QueueFull, Sequence
from wcache.engine.core.settings import CoreSettings
from wcache.engine.loading import waiting as cache_wait
from wcache.engine.worker.supervisor import Supervisor, start_local_ranks
from wcache.errors import CORE_SPARE_PREPARED, CORE_SPARE_PROMOTED, FRONT_GONE, RespawnError

log = logging.getLogger("wcache.engine")

STATUS_INTERVAL_S = 0.05  # how often the running/waiting gauges are compared and, if changed, sent
ARRIVALS_QUIET_S = 0.002  # an idle engine's first step waits while requests still arrive this often


class _Outbox:
    """A sequence's outbox in the core: what the step loop hands it goes to the next StepOutputs."""

    __slots__ = ("core", "id")

    def __init__(self, core: EngineCore, rid: int):
        self.core, self.id = core, rid

    def qsize(self) -> int:
        return 0  # the front counts what its reader has not taken (core_client.py)

    def put(self, item) -> None:
        self.core.hand(self.id, item)


class CoreEngine(Engine):
    """The engine's step loop, each step's outputs flushed to the front once it ends."""

    def __init__(self, runner: RankRunner, core: EngineCore):
        self.core = core  # before the loop starts (Engine.__init__ starts it)
        super().__init__(runner, tokenizer=None, stop_ids=frozenset())  # the front tokenizes; each request its stop ids

    def _step(self, step) -> None:
        try:
            super()._step(step)
        finally:
            self.core.flush()

    def _loop(self) -> None:
        try:
            super()._loop()
        finally:
            self.core.flush()  # the ends a failed loop handed every request
            if self.failure is not None:  # dead for good: the core exits 1, and the front with it
                self.core.stopping.set()

    def close(self) -> None:
        super().close()
        self.core.flush()


class _FrontHealth:
    """The Supervisor's ``server``: a rank that dies after start-up turns the front's /health to 503."""

    def __init__(self, core: EngineCore):
        self._core = core

    @property
    def ready(self) -> bool:
        return True

    @ready.setter
    def ready(self, value: bool) -> None:
        if not value:
            self._core.send(Unhealthy())


class EngineCore:
    def __init__(self, channel):
        self.channel = channel
        self.engine: CoreEngine | None = None
        self.supervisor: Supervisor | None = None
        self._seqs: dict[int, Sequence] = {}
        self._pending: dict[int, list] = {}  # id -> [tokens, end]
        self._lock = threading.Lock()
        self._out: queue.SimpleQueue = queue.SimpleQueue()
        self._last_add = 0.0
        self.stopping = threading.Event()
        self.proceed = threading.Event()
        self.spare = False  # a --respawn spare (Proceed's word): no KV cache before Promote
        self.promoted = threading.Event()
        threading.Thread(target=self._sender, name="wcache-core-send", daemon=True).start()

    # -- to the front ----------------------------------------------------------------------------
    def send(self, msg) -> None:
        self._out.put(msg)

    def _sender(self) -> None:
        while True:
            msg = self._out.get()
            if isinstance(msg, tuple):  # a step's outputs, built here rather than on the step loop
                pending, running, waiting = msg
                msg = StepOutputs([RequestOutput(rid, [token_of(t) for t in toks], end and end.reason,
                                                 str(end.error) if end and end.error else None,
                                                 prompt_scored_of(scores) if scores is not None else None)
                                   for rid, (toks, end, scores) in pending], running, waiting)
            try:
                self.channel.send(msg)
            except OSError:
                return  # the front is gone: the reader sees it too

    def hand(self, rid: int, item) -> None:
        with self._lock:
            entry = self._pending.get(rid)
            if entry is None:
                entry = self._pending[rid] = [[], None, None]
            if isinstance(item, _End):
                entry[1] = item
                self._seqs.pop(rid, None)
            elif isinstance(item, PromptScores):
                entry[2] = item
            else:
                entry[0].append(item)

    def flush(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, {}
        if pending:
            scheduler = self.engine.scheduler if self.engine is not None else None
            counts = (scheduler.num_running(), scheduler.num_waiting()) if scheduler is not None else (0, 0)
            self._out.put((list(pending.items()), *counts))

    # -- from the front --------------------------------------------------------------------------
    def serve_channel(self) -> None:
        """Read the front's messages until Shutdown or its close (on a thread of its own). However
        it ends, the core stops: a core whose reader is gone would hold its device for nobody."""
        try:
            while True:
                msg = self.channel.recv()
                if msg is None:
                    break
                if isinstance(msg, Shutdown):
                    self.stopping.set()
                    return
                try:
                    self._take(msg)
                except Exception as e:  # one message's failure is its request's, not the channel's
                    log.exception("The engine core could not take a %s", type(msg).__name__)
                    if isinstance(msg, AddRequest):
                        self._seqs.pop(msg.id, None)
                        self.send(StepOutputs([RequestOutput(msg.id, finished="error", error=str(e)[:200])]))
        except ChannelError as e:
            log.error("%s", e)
        except BaseException:
            log.exception("The engine core's channel reader failed")
        if self.engine is None:  # still loading: nobody will ever ask
            log.error(FRONT_GONE)
            if self.supervisor is not None:
                self.supervisor.abort()
            logging.shutdown()
            os._exit(1)
        log.warning(FRONT_GONE)
        self.stopping.set()

    def _take(self, msg) -> None:
        if isinstance(msg, AddRequest):
            self._add(msg)
        elif isinstance(msg, AbortRequest):
            seq = self._seqs.pop(msg.id, None)
            if seq is not None and self.engine is not None:
                self.engine.scheduler.cancel(seq)
        elif isinstance(msg, Proceed):
            self.spare = msg.spare
            self.proceed.set()
        elif isinstance(msg, Promote):
            self.promoted.set()

    def _add(self, msg: AddRequest) -> None:
        engine = self.engine
        seq = Sequence(msg.prompt_token_ids, msg.max_tokens, Sampler(params_of(msg.sampling).seeded()),
                       frozenset(msg.stop_token_ids))
        seq.replay.extend(msg.output_token_ids)  # a resumed request (front_failover.py): its tokens so far
        seq.sampler.bind(seq.prompt, seq.out, frozenset(msg.held_token_ids))  # as Engine.pieces binds it
        seq.outbox = _Outbox(self, msg.id)
        self._seqs[msg.id] = seq
        self._last_add = time.monotonic()
        try:
            if engine is None or engine.closed:
                raise RuntimeError("the engine is stopping")
            engine.scheduler.add(seq)
        except QueueFull as e:
            self._seqs.pop(msg.id, None)
            self.send(QueueFullError(msg.id, e.waiting, e.limit))
        except RuntimeError as e:
            self._seqs.pop(msg.id, None)
            self.send(StepOutputs([RequestOutput(msg.id, finished="error", error=str(e))]))

    def wait_arrived(self, timeout: float) -> bool:
        """The scheduler's burst wait (scheduler.py): here, until no request has arrived for
        ARRIVALS_QUIET_S (the front's connections are the front's; it sends each request as read)."""
        deadline = time.monotonic() + min(timeout, ARRIVAL_WAIT_S)
        while time.monotonic() < deadline:
            if time.monotonic() - self._last_add >= ARRIVALS_QUIET_S:
                return True
            time.sleep(ARRIVALS_QUIET_S / 4)
        return False

    def report_status(self) -> None:
        """The gauges the front's /metrics shows, sent when they change, and every BEAT_S while
        requests run: the heartbeat by which a --respawn front tells a stopped core from a busy one
        (front_failover.py). An idle core, a spare among them, stays quiet."""
        last, sent = None, 0.0
        while not self.stopping.wait(STATUS_INTERVAL_S):
            engine = self.engine
            now = (engine.num_requests_running(), engine.num_requests_waiting(), engine.daemon_alive())
            busy = now[0] or now[1]
            if now != last or (busy and time.monotonic() - sent >= BEAT_S):
                self.send(Status(*now))
                last, sent = now, time.monotonic()


def run_core(settings: CoreSettings, loader_config, channel) -> int:
    """``run_serve``'s start-up and step loop, with the front on the other end of ``channel``."""
    core = EngineCore(channel)
    threading.Thread(target=core.serve_channel, name="wcache-core-recv", daemon=True).start()
    # The loader's wait for the daemon is told to the front, whose /health shows it (waiting.py).
    cache_wait.subscribe(lambda body: core.send(Waiting(body and {k: body[k] for k in ("socket", "reason", "timeout_s")})))
    plan, specs = rank_specs(settings.engine, loader_config)
    if settings.respawn and plan.world_size > 1:  # spares and resumes are one rank's (front_failover.py)
        raise RespawnError(RespawnError.ONE_RANK.format(world=f"{plan.world_size} ranks", layout=plan.layout.describe()))
    core.send(Planned(plan.drives))
    # Nothing loads before the front holds its port: a port already taken stays its one line, and
    # the front ends this process before it has printed anything.
    core.proceed.wait()
    runner = RankRunner.from_spec(specs[0])
    if not runner.plain:
        log.info("Engine for data-parallel rank %d: %s; %d rank(s) here, engine world of %d at %s", plan.dp_rank,
                 plan.layout.describe(), len(specs), plan.world_size, plan.init_method)
    start = runner.start
    if core.spare:
        if not _prepare_spare(core, runner):
            return 0  # told to stop while it waited
        start = runner.finish  # the KV cache, sized to what the dead core left free
    supervisor = core.supervisor = start_local_ranks(runner, specs, plan, _FrontHealth(core), start)
    engine = CoreEngine(runner, core)
    engine.scheduler.wait_arrived = core.wait_arrived
    core.engine = engine
    r = runner.report
    core.send(Ready(os.getpid(), engine.max_model_len, engine.max_num_seqs, engine.has_draft, runner.cfg.device,
                    runner.cfg.hf.get("vocab_size"), engine.load_format,
                    LoadInfo(r.source, r.seconds, r.external_bytes, r.fallback_kind, r.transport)))
    threading.Thread(target=core.report_status, name="wcache-core-status", daemon=True).start()
    front = os.getppid()
    while not core.stopping.wait(1.0):
        if os.getppid() != front:  # the front died and this process was adopted: nobody to serve
            log.warning(FRONT_GONE)
            break
    supervisor.stopping = True
    engine.close()
    supervisor.stop()
    code = engine.exit_code()
    log.info("Engine core stopped")
    if runner.world.size > 1:
        exit_after_collectives(code)
    return code


def _prepare_spare(core: EngineCore, runner: RankRunner) -> bool:
    """A --respawn spare (front_failover.py): weights and warm-up now, then wait for Promote, so it
    holds no KV cache while the serving core holds its own (two, each sized to the device's free
    memory, do not fit a GPU). False: the front told it to stop before promoting it."""
    t0 = time.monotonic()
    runner.prepare()
    log.info(CORE_SPARE_PREPARED.format(pid=os.getpid(), seconds=time.monotonic() - t0, source=runner.report.source))
    core.send(Prepared(os.getpid()))
    while not core.promoted.wait(0.5):
        if core.stopping.is_set():
            runner.close()
            return False
    log.info(CORE_SPARE_PROMOTED.format(pid=os.getpid()))
    return True
