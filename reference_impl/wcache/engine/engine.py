"""The engine: what the HTTP server calls, over a world of any size; and ``wcache serve``'s start-up.

``Engine`` wraps engine rank 0's ``RankRunner`` (runner.py). With one rank it just decodes; with
several it first broadcasts each request to the other ranks, and keeps an idle world alive.
``run_serve`` is the one start-up path: listen (``/health`` answers 503), start the other local
ranks (supervisor.py), load and size memory on every rank, then serve.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass

from wcache.core.config import EngineConfig
from wcache.core.distributed import exit_after_collectives
from wcache.core.ranks import SPEC_SOCKET_PATH, check_draft, plan_engine
from wcache.core.speculative import CACHED_DRAFT_METHODS, parse_speculative_config
from wcache.engine.runner import (
    OP_GENERATE,
    OP_KEEPALIVE,
    OP_STOP,
    EngineOptions,
    RankRunner,
    rank_spec,
)
from wcache.engine.sampling import GREEDY, SamplingParams
from wcache.engine.textstream import TextStream
from wcache.engine.world import LOST_PEERS
from wcache.errors import ParallelConfigError
from wcache.model import tokenizer

log = logging.getLogger("wcache.engine")

KEEPALIVE_S = 60.0


@dataclass(frozen=True)
class Completion:
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" (EOS or a stop string) or "length"
    stop_reason: str | None  # the stop string that ended it (None for EOS or length, as vLLM)
    prompt_tokens: int


class Engine:
    """Engine rank 0: one sequence at a time (they share each rank's KV cache)."""

    def __init__(self, runner: RankRunner):
        self.runner = runner
        self.cfg = runner.cfg
        self.report = runner.report
        self.max_model_len = runner.max_model_len
        self._lock = threading.Lock()
        self._last = time.monotonic()
        self.closed = False
        if runner.world.size > 1:
            threading.Thread(target=self._keepalive, name="wcache-keepalive", daemon=True).start()

    @classmethod
    def start(cls, cfg: EngineConfig, options: EngineOptions | None = None) -> Engine:
        """An engine of this process's rank alone (a world of one, unless ``cfg.ranks`` says otherwise)."""
        runner = RankRunner(cfg, options or EngineOptions())
        runner.start()
        return cls(runner)

    @property
    def memory(self):
        return self.runner.memory

    @property
    def kv_cache(self):
        return self.runner.kv_cache

    def _keepalive(self) -> None:
        while not self.closed:
            time.sleep(1.0)
            with self._lock:
                if self.closed or time.monotonic() - self._last < KEEPALIVE_S:
                    continue
                try:
                    self.runner.send_request(OP_KEEPALIVE)
                except RuntimeError as e:
                    log.error(LOST_PEERS.format(rank=0, error=str(e).splitlines()[0]))
                    return
                self._last = time.monotonic()

    @property
    def has_draft(self) -> bool:
        return self.runner.draft is not None

    def generate(self, prompt: str, max_tokens: int, sampling: SamplingParams = GREEDY, stop=(),
                 on_text=None) -> Completion:
        """One completion. ``on_text(piece) -> bool`` is told each new piece of final text as it is
        decoded (textstream.py) and returns True to stop early (a streaming client went away)."""
        ids = tokenizer.encode(prompt)
        text = TextStream(stop)
        sampling = sampling.seeded()  # every rank draws with the same seed
        gone = False

        def on_token(tok: int) -> bool:
            nonlocal gone
            piece = text.push(tok)
            if on_text is not None and piece and not gone:
                gone = bool(on_text(piece))
            return text.stopped or gone

        r = self.runner
        with self._lock:
            before = (r.proposed, r.accepted)
            stops = bool(text.stop) or on_text is not None
            r.send_request(OP_GENERATE, ids, max_tokens, sampling, stops=stops)
            out = r.decode(ids, max_tokens, tokenizer.EOS_ID, sampling, on_token=on_token, stops=stops)
            self._last = time.monotonic()
        if r.draft is not None:
            log.info("Speculative decoding (%s): accepted %d of %d draft tokens", r.draft_spec["method"],
                     r.accepted - before[1], r.proposed - before[0])
        rest = text.finish()
        if on_text is not None and rest and not gone:
            on_text(rest)
        finish = "stop" if text.stopped or (out and out[-1] == tokenizer.EOS_ID) else "length"
        return Completion(text.text, out, finish, text.stop_reason, len(ids))

    def complete(self, prompt: str, max_tokens: int) -> tuple[str, list[int], str, int]:
        """Greedy (text, token ids, finish reason, prompt tokens)."""
        c = self.generate(prompt, max_tokens)
        return c.text, c.token_ids, c.finish_reason, c.prompt_tokens

    def close(self) -> None:
        with self._lock:
            if self.closed:
                return
            self.closed = True
            try:
                self.runner.send_request(OP_STOP)
            except RuntimeError:
                pass  # a worker already gone; the supervisor says which
            finally:  # the leases, and any hand-back offer, go whatever the world did
                self.runner.close()


def rank_specs(args, loader_config):
    """(plan, one JSON spec per local rank of this engine) from ``wcache serve`` arguments."""
    base = EngineConfig.build(args.model, args.dtype, args.quantization, args.device, revision=args.revision)
    plan = plan_engine(args, base.hf, base.device)
    draft = None
    sc = parse_speculative_config(args.speculative_config)
    if sc is not None:
        check_draft(sc, base.hf, plan.layout.tp, plan.layout.pp)
        if sc.cached and args.load_format == "ipc_cache" and loader_config.socket_path:
            raise ParallelConfigError(SPEC_SOCKET_PATH.format(methods=", ".join(CACHED_DRAFT_METHODS)))
        draft = {"method": sc.method, "model": sc.model, "k": sc.num_speculative_tokens, "cached": sc.cached,
                 "dtype": args.dtype}
    options = EngineOptions(
        load_format=args.load_format, loader_config=loader_config, max_model_len=args.max_model_len,
        gpu_memory_utilization=args.gpu_memory_utilization, cpu_memory_capacity=args.cpu_memory_capacity,
        enable_autotune=args.enable_autotune, draft=draft, init_method=plan.init_method,
        backend="nccl" if base.device == "cuda" else "gloo")
    model_flags = {"model": args.model, "dtype": args.dtype, "quantization": args.quantization,
                   "device": base.device, "revision": args.revision}
    return plan, [rank_spec(model_flags, r, options) for r in plan.local]


def run_serve(args, loader_config, sock=None, answer_while_loading: bool = True, on_ready=None,
              prepared: RankRunner | None = None) -> int:
    """``wcache serve``: every world size, one path.

    A ``--respawn`` worker (engine/spare.py) passes the listening socket its supervisor bound
    (``sock``); a promoted spare leaves clients in the backlog until it is ready
    (``answer_while_loading=False``) and reports readiness with ``on_ready(engine, server)``. A hot
    spare passes the rank it ``prepare``d while waiting (``prepared``): only its KV cache is left to do.
    """
    from wcache.engine.server import EngineServer, run_until_signal
    from wcache.engine.supervisor import Supervisor

    plan, specs = rank_specs(args, loader_config)
    runner = prepared or RankRunner.from_spec(specs[0])
    if not runner.plain:
        log.info("Engine for data-parallel rank %d: %s; %d rank(s) here, engine world of %d at %s", plan.dp_rank,
                 plan.layout.describe(), len(specs), plan.world_size, plan.init_method)
    server = None
    if plan.drives and answer_while_loading:
        # Listen before loading so /health answers 503 while weights load (readiness probes).
        server = EngineServer.from_args(args, None, sock)
        log.info("Serving on http://%s:%d (health 503 until %s)", args.host, args.port,
                 "weights are loaded" if runner.plain else "every rank has its weights")
    supervisor = Supervisor(specs[1:], server)
    try:
        runner.finish() if prepared is not None else runner.start()
    except BaseException:
        supervisor.abort()
        if server is not None:
            server.server_close()
        raise
    supervisor.started_ok = True
    if not plan.drives:
        from wcache.engine.runner import serve_requests

        log.info("Engine node %d ready: %d rank(s) follow engine rank 0 at %s", plan.layout.node_rank,
                 len(specs), plan.init_method)
        code = serve_requests(runner)
        supervisor.stop()
        exit_after_collectives(code)
    engine = Engine(runner)

    def on_stop() -> None:
        supervisor.stopping = True
        engine.close()
        supervisor.stop()

    if server is None:  # a promoted --respawn spare: clients waited in the backlog until now
        server = EngineServer.from_args(args, engine, sock)
    server.engine, server.ready = engine, True
    log.info("Engine ready (pid %d): POST http://%s:%d/v1/completions", os.getpid(), args.host, args.port)
    if on_ready is not None:
        on_ready(engine, server)
    run_until_signal(server, on_stop=on_stop)
    log.info("Engine stopped")
    if runner.world.size > 1:
        exit_after_collectives(0)  # past gloo's teardown, which may abort once peers are gone
    return 0
