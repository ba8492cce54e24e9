"""The engine: what the HTTP server calls, over a world of any size (serve.py starts it).

``Engine`` wraps engine rank 0's ``RankRunner`` (runner.py) and batches requests continuously
(scheduler.py): every step, each running sequence gets one token, and requests join and leave
between steps. With several ranks, every forward pass is announced to the others (one header per
pass), and an idle world is kept alive. ``rank_specs`` turns `wcache serve`'s engine settings
into one spec per local rank.
"""

from __future__ import annotations

import functools
import json
import logging
import sys
import threading
import time

import torch

from wcache.core.config import EngineConfig
from wcache.core.ranks import SPEC_SOCKET_PATH, check_draft, plan_engine
from wcache.core.speculative import CACHED_DRAFT_METHODS, parse_speculative_config
from wcache.engine.core.completion import STREAM_BUFFER_TOKENS, Completion, _End, drive, read_completion, stop_sets
from wcache.engine.worker.logprobs import score_prompt
from wcache.engine.worker.loop_thread import LoopThread
from wcache.engine.worker.outputs import Sampled
from wcache.engine.worker.runner import (
    OP_KEEPALIVE,
    OP_STOP,
    TARGET,
    EngineOptions,
    RankRunner,
    rank_spec,
)
from wcache.engine.worker.sampling import (
    GREEDY,
    Sampler,
    SamplingParams,
    greedy_picks,
    pick_rows,
)
from wcache.engine.core.scheduler import QueueFull, Scheduler, Sequence  # noqa: F401 (QueueFull: the HTTP layer's)
from wcache.engine.core.settings import EngineSettings
from wcache.engine.core.step_clock import StepClock
from wcache.engine.core.textstream import TextStream
from wcache.engine.worker.world import LOST_PEERS
from wcache.errors import ENGINE_DEAD, STREAM_OVERFLOW, TEXT_WITHOUT_TOKENIZER, MaxModelLenError, ParallelConfigError
from wcache.model import generation_config
from wcache.model.tokenizer import Tokenizer

log = logging.getLogger("wcache.engine")

KEEPALIVE_S = 60.0
GIL_SWITCH_S = 0.0005  # a GPU engine's Python thread switch interval (sys.setswitchinterval)

# Logged when the engine stops; the HTTP bench reads them (what the loop adds to the forward passes,
# and where a step's time goes: step_clock.py).
STEP_STATS = "Engine steps (ms per step): {json}"
STEP_PROFILE = "Engine step profile: {json}"


class StepStats:
    """What the engine loop spends per step beyond the model's forward passes (the bench prints it)."""

    def __init__(self):
        self.steps = self.tokens = 0
        self.step_s = self.forward_s = 0.0

    def as_json(self) -> dict:
        n = max(self.steps, 1)
        return {"steps": self.steps, "tokens": self.tokens, "step_ms": round(1e3 * self.step_s / n, 4),
                "forward_ms": round(1e3 * self.forward_s / n, 4),
                "overhead_ms": round(1e3 * (self.step_s - self.forward_s) / n, 4)}


class Engine:
    """Engine rank 0: continuous batching over every rank (scheduler.py decides each step).

    HTTP threads call ``generate``, which queues the request and then drains its outbox; one engine
    thread (``_loop``) runs the steps: the prompts of requests that join (on CPU one pass per prompt
    length), then one decode pass for every sequence that was already running, sampling each row
    with its own sampler. The loop never
    writes to a client: tokens go to per-request outboxes, and a request more than
    ``STREAM_BUFFER_TOKENS`` behind is ended (``overflow``) so its slot serves others.
    """

    def __init__(self, runner: RankRunner, tokenizer: Tokenizer | None | str = "auto",
                 stop_ids: frozenset[int] | None = None):
        """``tokenizer``: the checkpoint's (``"auto"``: read from the model directory), or None to
        serve token ids only (``--skip-tokenizer-init``). ``stop_ids``: the ids that end a completion
        (default: the checkpoint's, generation_config.py)."""
        self.runner = runner
        self.cfg = runner.cfg
        self.tokenizer = Tokenizer.load(self.cfg.model) if tokenizer == "auto" else tokenizer
        self.stop_ids = stop_ids if stop_ids is not None else generation_config.stop_ids(
            self.cfg.model, self.tokenizer.eos_token_id if self.tokenizer else None)
        self.report = runner.report
        self.max_model_len = runner.max_model_len
        self.scheduler = Scheduler(runner.num_seqs, runner.options.max_waiting_requests)
        # float32 (and float16) matrix products on CPU round differently for one row and for many
        # (BLAS picks a matrix-vector kernel for one row), so a batched row could differ in the last
        # bits from the same request alone; those engines run each row, and each prompt, as its own
        # pass. bfloat16 on CPU, the presets' dtype, is batch-invariant
        # (tests/integration/test_batching.py, tests/unit/test_model.py).
        self.row_by_row = self.cfg.device == "cpu" and runner.model.dtype != torch.bfloat16
        self.stats = StepStats()
        self.clock = StepClock(runner.device)
        self.closed = False
        self.failure: BaseException | None = None  # why the engine loop ended, when it failed
        self._close_lock = threading.Lock()
        if runner.gpu is not None:
            # The engine thread waits for the GPU once per step, and then for the GIL, which the HTTP
            # threads hold in turn: by default a waiting thread asks for it after 5 ms, a step's worth.
            sys.setswitchinterval(GIL_SWITCH_S)
        # A spare's warm-up ran on the runner's loop thread: the loop runs there too (loop_thread.py).
        self._loop_thread = runner.thread or LoopThread()
        runner.thread = None
        self._loop_thread.run_last(self._loop)

    @classmethod
    def start(cls, cfg: EngineConfig, options: EngineOptions | None = None, tokenizer="auto") -> Engine:
        """An engine of this process's rank alone (a world of one, unless ``cfg.ranks`` says otherwise)."""
        tokenizer = Tokenizer.load(cfg.model) if tokenizer == "auto" else tokenizer  # refused before loading
        runner = RankRunner(cfg, options or EngineOptions())
        runner.start()
        return cls(runner, tokenizer)

    @property
    def memory(self):
        return self.runner.memory

    @property
    def kv_cache(self):
        return self.runner.kv_cache

    @property
    def has_draft(self) -> bool:
        return self.runner.draft is not None

    @property
    def load_format(self) -> str:
        return self.runner.options.load_format

    def daemon_alive(self) -> float | None:
        """zero_copy: whether the daemon whose memory this engine maps still holds the lease
        (engine/api_server/metrics.py shows it); None for other loads."""
        from wcache.engine.loading.lease import daemon_alive

        lease = self.runner.loads[0].lease if self.runner.loads else None
        return daemon_alive(lease) if lease is not None else None

    @property
    def max_num_seqs(self) -> int:
        """Sequences decoded together: --max-num-seqs, or fewer if the KV cache holds fewer."""
        return self.runner.num_seqs

    def num_requests_running(self) -> int:
        return self.scheduler.num_running()

    def num_requests_waiting(self) -> int:
        return self.scheduler.num_waiting()

    # -- a request's thread ---------------------------------------------------------------------
    def generate(self, prompt: str | list[int], max_tokens: int, sampling: SamplingParams = GREEDY, stop=(),
                 on_text=None, queued=None, skip_special_tokens: bool = True, **stopping) -> Completion:
        """One completion. ``prompt``: text, or token ids used as they are. ``on_text(piece) -> bool``
        is told each new piece of final text as it is decoded (textstream.py), on this thread, and
        returns True to stop early (a streaming client went away): the sequence then leaves the
        batch before the next step. ``queued()`` is called once the request is in the scheduler's
        queue. Raises ``QueueFull`` when ``--max-waiting-requests`` wait. ``stopping``: ``pieces``'s."""
        return drive(self.pieces(prompt, max_tokens, sampling, stop, queued, skip_special_tokens, **stopping), on_text)

    def pieces(self, prompt: str | list[int], max_tokens: int, sampling: SamplingParams = GREEDY, stop=(),
               queued=None, skip_special_tokens: bool = True, stop_token_ids=(), ignore_eos: bool = False,
               include_stop: bool = False):
        """``generate`` as a generator, on the caller's thread: yields each new piece of final text;
        ``send(True)`` stops the sequence at its next token, as ``close()`` does; returns the
        Completion. A streamed response writes each piece as it comes, with no thread in between.
        With logprobs asked for, every token yields a piece (TextPiece, its text possibly empty)
        carrying its scores. vLLM's stop settings: ``stop_token_ids`` end it too (``stop_reason``
        the id); ``ignore_eos``: only they do, not the checkpoint's EOS ids; ``include_stop``: the
        stop string or id's text stays in the text."""
        if isinstance(prompt, str) and self.tokenizer is None:
            raise ValueError(TEXT_WITHOUT_TOKENIZER)
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
        own_stops, stop_ids, held = stop_sets(self.stop_ids, stop_token_ids, ignore_eos)
        seq = Sequence(ids, max_tokens, Sampler(sampling.seeded()), stop_ids)
        seq.sampler.bind(seq.prompt, seq.out, held)  # min_tokens holds back every stop id (completion.stop_sets)
        if self.closed:
            raise RuntimeError("the engine is stopping")
        self.scheduler.add(seq)
        if queued is not None:
            queued()
        text = TextStream(self.tokenizer.stream(skip_special_tokens) if self.tokenizer else None, stop,
                          include_stop, sampling.min_tokens)
        eos = self.tokenizer.eos_token_id if self.tokenizer else None
        return (yield from read_completion(seq.outbox.get, lambda: self.scheduler.cancel(seq), ids, stop_ids,
                                           own_stops, eos, text, sampling.logprobs is not None))

    def complete(self, prompt: str, max_tokens: int) -> tuple[str, list[int], str, int]:
        """Greedy (text, token ids, finish reason, prompt tokens)."""
        c = self.generate(prompt, max_tokens)
        return c.text, c.token_ids, c.finish_reason, c.prompt_tokens

    # -- the engine thread ------------------------------------------------------------------------
    def _loop(self) -> None:
        r = self.runner
        try:
            while True:
                self.clock.begin()
                busy = self.scheduler.num_running() > 0  # the last step left sequences running
                step = self.scheduler.next_step(KEEPALIVE_S)
                if step is None:
                    return  # closed
                if not step.running:  # idle for KEEPALIVE_S: keep the other ranks' collectives alive
                    if r.world.size > 1:
                        r.send_op(OP_KEEPALIVE)
                    continue
                self.clock.scheduled(busy)
                self._step(step)
        except BaseException as e:  # a lost peer: every request still here fails, new ones are refused
            if isinstance(e, RuntimeError):
                log.error(LOST_PEERS.format(rank=0, error=str(e).splitlines()[0]))
            else:
                log.exception("The engine loop failed")
            # Dead for good: /health answers 503 and the server stops (run_until_signal watches this),
            # so a supervisor (--respawn, the kubelet) replaces the process instead of routing to it.
            self.failure = e
            for seq in self.scheduler.close():
                seq.outbox.put(_End("error", e))

    def _step(self, step) -> None:
        r, t0 = self.runner, time.perf_counter()
        self._forward = 0.0
        decoded = graph_rows = prompts = 0
        for seq in step.running:  # leave first: requests whose thread stopped reading
            if seq.cancelled:
                self._finish(seq, "cancelled")
        rows = [s for s in step.running if s.slot >= 0]
        if r.draft is not None:  # one slot: at most one sequence, a draft-then-verify round
            for seq in rows:
                before = (r.proposed, r.accepted)
                speculate = functools.partial(r.speculate, seq.slot, seq.prompt + seq.out, seq.lens)
                new = self._pass("decode_pass", speculate, None)
                decoded += 1
                seq.spec[0] += r.proposed - before[0]
                seq.spec[1] += r.accepted - before[1]
                self._emit(seq, new)
        else:
            for group in prompt_groups([s for s in step.joining if s.slot >= 0], r.max_model_len,
                                       together=r.gpu is None and not self.row_by_row):
                # Joining requests' prompts (their first tokens): prompts of one length share a pass.
                # Every row sampled before any is handed on: a handed token wakes its request's
                # thread, which then holds the GIL between the sampler's PyTorch calls (16 prompts
                # on a 2-core CPU: their first tokens went out over 5 ms instead of at once).
                scored = _scores_prompt(group[0])  # alone in its pass (prompt_groups)
                run = functools.partial(r.run, TARGET, [s.slot for s in group], [0] * len(group),
                                        [s.prompt for s in group], 0 if scored else None)
                toks = self._pass("prompt_pass", run, group, scored)
                prompts += 1
                for seq, tok in zip(group, toks):
                    self._emit(seq, [tok])
            # Sequences that joined now decode from the next step: a step with prompts in it ends
            # sooner, so requests that arrived meanwhile join one step earlier (16 streaming clients
            # at once on a 2-core CPU: time to first token p99 from about 7 to about 5 times a lone
            # request's). Same tokens: a sequence's passes are the same, only the step differs.
            joined = set(step.joining)
            rows = [s for s in rows if s.slot >= 0 and s not in joined]
            batches = [[s] for s in rows] if self.row_by_row else [rows] if rows else []
            for batch in batches:  # one decode pass for every running sequence
                run = functools.partial(r.run, TARGET, [s.slot for s in batch], [s.position for s in batch],
                                        [[s.out[-1]] for s in batch])
                toks = self._pass("decode_pass", run, batch)
                decoded += len(batch)
                graph_rows += r.gpu.last_rows if r.gpu is not None else len(batch)
                for seq, tok in zip(batch, toks):
                    self._emit(seq, [tok])
        if r.world.size == 1 and r.draft is None:
            # Running slots packed at the bottom: a GPU step decodes the slots up to the last running
            # one (gpu_steps.py). The keys move with their sequence (every position it holds).
            for seq, old, new in self.scheduler.compact():
                r.move_slot(old, new, seq.position)
        st = self.stats
        st.steps += 1
        st.step_s += time.perf_counter() - t0
        st.forward_s += self._forward
        self.clock.end(decoded, graph_rows, prompts, busy_after=self.scheduler.num_running() > 0)

    def _pass(self, phase: str, run, seqs: list[Sequence] | None, scored: bool = False):
        """``run()``, one forward pass (or a speculative round, ``seqs`` None: its tokens), and the
        tokens sampled from its logits for ``seqs`` (outputs.Sampled records), each part timed on
        the step's clock. ``scored``: the pass gave every prompt position's logits (one sequence),
        and its prompt is scored before its first token is handed."""
        clock = self.clock
        clock.device_begin()
        f0 = time.perf_counter()
        out = run()
        f1 = time.perf_counter()
        self._forward += f1 - f0
        clock.add(phase, f1 - f0)
        if scored:
            [seq] = seqs
            seq.outbox.put(score_prompt(out[0, :-1], seq.prompt, seq.sampler.params.prompt_logprobs))
            out = out[:, -1]
        greedy = greedy_picks([s.sampler for s in seqs], out) if seqs is not None else None
        waited = clock.device_end()  # (after the argmax, so the device's time includes it)
        if seqs is not None:
            out = pick_rows([s.sampler for s in seqs], out, greedy)
        clock.add("sample", time.perf_counter() - f1 - waited)
        return out

    def _emit(self, seq: Sequence, tokens: list[int]) -> None:
        """Hand new tokens to the request's thread; end the sequence at EOS, max_tokens, or when
        its thread is too far behind."""
        t0 = time.perf_counter()
        try:
            self._hand(seq, tokens)
        finally:
            self.clock.add("hand", time.perf_counter() - t0)

    def _hand(self, seq: Sequence, tokens: list[Sampled | int]) -> None:
        for tok in tokens:
            if seq.replay:  # a resumed sequence re-runs a token it was sent already (core_engine.py)
                seq.out.append(seq.replay.popleft())
                continue
            if not isinstance(tok, Sampled):  # a speculative round's plain ids
                tok = Sampled(tok)
            seq.out.append(tok.id)
            self.stats.tokens += 1
            if seq.outbox.qsize() >= STREAM_BUFFER_TOKENS:
                log.warning(STREAM_OVERFLOW.format(limit=STREAM_BUFFER_TOKENS))
                self._finish(seq, "overflow")
                return
            seq.outbox.put(tok)
            if tok.id in seq.stop_ids or len(seq.out) >= seq.max_tokens:
                self._finish(seq, "eos" if tok.id in seq.stop_ids else "length")
                return

    def _finish(self, seq: Sequence, reason: str) -> None:
        self.scheduler.finish(seq)
        seq.slot = -1
        seq.outbox.put(_End(reason))
        if self.runner.draft is not None:
            log.info("Speculative decoding (%s): accepted %d of %d draft tokens", self.runner.draft_spec["method"],
                     seq.spec[1], seq.spec[0])

    def exit_code(self) -> int:
        """The serve's exit status once it stopped: 1, with ENGINE_DEAD's line, if the loop failed."""
        if self.failure is None:
            return 0
        log.error(ENGINE_DEAD.format(error=str(self.failure).splitlines()[0] if str(self.failure) else
                                     type(self.failure).__name__))
        return 1

    def close(self) -> None:
        with self._close_lock:
            if self.closed:
                return
            self.closed = True
        for seq in self.scheduler.close():
            seq.outbox.put(_End("abort"))
        self._loop_thread.join(60.0)  # the step under way ends; then no other thread talks to the ranks
        if self.stats.steps:
            log.info(STEP_STATS.format(json=json.dumps(self.stats.as_json(), sort_keys=True)))
            log.info(STEP_PROFILE.format(json=json.dumps(self.clock.as_json(), sort_keys=True)))
        try:
            self.runner.send_op(OP_STOP)
        except RuntimeError:
            pass  # a worker already gone; the supervisor says which
        finally:  # the leases, and any hand-back offer, go whatever the world did
            self.runner.close()


def prompt_groups(joining: list[Sequence], max_tokens: int, together: bool = True) -> list[list[Sequence]]:
    """Joining sequences in passes: prompts of the same length together (a pass's rows have one
    length), at most ``max_tokens`` prompt tokens and header entries per pass, so no pass needs
    more activation memory than the longest prompt the memory plan measured, or a longer header.
    Not ``together`` (a GPU decoding in tiles): one prompt per pass, as it would run alone, because
    the GPU's matrix kernels are chosen by the number of rows, and a prompt's keys must not depend
    on which others arrived with it."""
    by_length: dict[int, list[Sequence]] = {}
    out = []
    for seq in joining:
        if _scores_prompt(seq):
            out.append([seq])  # every position's logits: its own pass, the same alone or among others
        else:
            by_length.setdefault(len(seq.prompt), []).append(seq)
    for length, seqs in by_length.items():
        per_pass = max(1, (max_tokens + 2) // (length + 2)) if together else 1
        out += [seqs[i : i + per_pass] for i in range(0, len(seqs), per_pass)]
    return out


def _scores_prompt(seq: Sequence) -> bool:
    """Whether its prompt pass scores the prompt: asked, and not a resumed sequence (scored already)."""
    return seq.sampler.params.prompt_logprobs is not None and not seq.replay


def rank_specs(s: EngineSettings, loader_config):
    """(plan, one JSON spec per local rank of this engine) from ``wcache serve``'s engine settings."""
    base = EngineConfig.build(s.model, s.dtype, s.quantization, s.device, revision=s.revision)
    derived = base.hf["max_position_embeddings"]
    if s.max_model_len is not None and s.max_model_len > derived:  # refused before loading, as vLLM does
        raise MaxModelLenError(MaxModelLenError.TOO_LONG.format(requested=s.max_model_len, derived=derived))
    plan = plan_engine(s.parallel, base.hf, base.device)
    draft = None
    sc = parse_speculative_config(s.parallel.speculative_config)
    if sc is not None:
        check_draft(sc, base.hf, plan.layout.tp, plan.layout.pp)
        if sc.cached and s.load_format == "ipc_cache" and loader_config.socket_path:
            raise ParallelConfigError(SPEC_SOCKET_PATH.format(methods=", ".join(CACHED_DRAFT_METHODS)))
        draft = {"method": sc.method, "model": sc.model, "k": sc.num_speculative_tokens, "cached": sc.cached,
                 "dtype": s.dtype}
    options = EngineOptions(
        load_format=s.load_format, loader_config=loader_config, max_model_len=s.max_model_len,
        gpu_memory_utilization=s.gpu_memory_utilization, cpu_memory_capacity=s.cpu_memory_capacity,
        enable_autotune=s.enable_autotune, draft=draft, init_method=plan.init_method,
        backend="nccl" if base.device == "cuda" else "gloo", max_num_seqs=s.max_num_seqs,
        max_waiting_requests=s.max_waiting_requests, enforce_eager=s.enforce_eager)
    model_flags = {"model": s.model, "dtype": s.dtype, "quantization": s.quantization,
                   "device": base.device, "revision": s.revision}
    return plan, [rank_spec(model_flags, r, options) for r in plan.local]
