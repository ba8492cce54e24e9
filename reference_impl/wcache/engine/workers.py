"""The multi-rank engine: one process per rank, torch.distributed between them.

``wcache serve`` with ``--tensor-parallel-size``/``--pipeline-parallel-size`` > 1 (or a data-parallel
rank, several nodes, or a speculative draft) runs here. The serve process is its node's first rank;
every other local rank is a fresh interpreter (``python -m wcache.engine.workers``, never a fork of a
process that ran torch) that gets its settings as JSON in the environment. Each rank loads exactly
its own shard, from disk or from its own daemon socket (the ipc_cache loader picks the socket from
the rank's local rank), then all ranks of the engine meet in one world on
``--master-addr``/``--master-port`` (gloo on CPU, nccl on CUDA).

The computation is SPMD: engine rank 0 (on the node holding it) serves HTTP and, for each request,
broadcasts a small int64 header and the prompt's token ids; every rank then runs the same decoding
loop. Tensor-parallel ranks all-reduce the two row-parallel projections of every layer
(``Llama.set_all_reduce``); pipeline stages hand hidden states to the next stage with send/recv;
the last stage broadcasts the logits, so every rank takes the same greedy decision. Nothing but
tensors crosses between ranks (no pickle).

With ``--speculative-config`` every rank also holds its shard of a draft model (from the draft
daemon group's ``_draft`` sockets when the method is cached); decoding is then greedy
draft-then-verify: the draft proposes ``num_speculative_tokens`` tokens, the target scores them in
one forward pass, and the longest agreeing prefix plus the target's own next token is kept. The
output is the target's greedy output.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict
from datetime import timedelta

import torch
import torch.distributed as dist

from wcache.core import autotune
from wcache import logs
from wcache.model import tokenizer
from wcache.core.config import EngineConfig
from wcache.engine.engine import load_weights
from wcache.errors import UserError
from wcache.engine.loader import parse_loader_config
from wcache.model.llama import Llama, bind_weights, build_meta_model
from wcache.core.ranks import (
    CACHED_DRAFT_METHODS,
    SPEC_SOCKET_PATH,
    ParallelConfigError,
    check_draft,
    exit_after_collectives,
    parse_speculative_config,
    plan_engine,
)

log = logging.getLogger("wcache.workers")

SPEC_ENV = "WCACHE_WORKER_SPEC"
OP_GENERATE, OP_STOP, OP_KEEPALIVE = 1, 2, 3
# Idle ranks wait in a broadcast for the next request; rank 0 sends a keepalive well within the
# collective timeout so an idle engine never times out, while a dead peer is still noticed.
DIST_TIMEOUT = timedelta(minutes=30)
KEEPALIVE_S = 60.0
STOP_GRACE_S = 10.0

WORKERS_STARTUP_FAILED = "Engine worker rank(s) exited during startup (exitcodes={codes})"
WORKERS_EXITED = "Engine worker rank(s) exited (exitcodes={codes}); /health now answers 503"
LOST_PEERS = "Engine rank {rank} lost contact with the other ranks: {error}"


class RankRunner:
    """One engine rank: its models, its KV caches per request, and its place in the world."""

    def __init__(self, spec: dict):
        self.spec = spec
        self.cfg = EngineConfig.from_spec(spec)
        self.ranks = self.cfg.ranks
        self.tp, self.pp = self.ranks.tp_size, self.ranks.pp_size
        self.world = self.tp * self.pp
        self.rank = self.ranks.pp_rank * self.tp + self.ranks.tp_rank
        self.device = self.cfg.torch_device
        self.draft_spec = spec.get("draft")
        self.model: Llama | None = None
        self.draft: Llama | None = None
        self.reports: list = []
        self.tp_group = None
        self.proposed = self.accepted = 0
        self.trace: list | None = None  # set to a list to record every forward pass's logits (tests)

    # -- startup -----------------------------------------------------------------------------
    def join(self) -> None:
        if self.world == 1:
            return
        if self.spec["backend"] == "nccl":
            torch.cuda.set_device(self.device)
        dist.init_process_group(self.spec["backend"], init_method=self.spec["init_method"], rank=self.rank,
                                world_size=self.world, timeout=DIST_TIMEOUT)
        if self.pp > 1 and self.tp > 1:  # one tensor-parallel group per stage; every rank makes all of them
            for stage in range(self.pp):
                group = dist.new_group([stage * self.tp + t for t in range(self.tp)])
                if stage == self.ranks.pp_rank:
                    self.tp_group = group
        log.info("Engine rank %d of %d joined the world at %s", self.rank, self.world, self.spec["init_method"])

    def load(self) -> None:
        lc = parse_loader_config(self.spec["loader_config"])
        fmt = self.spec["load_format"]
        self.model = self._load(self.cfg, fmt, lc, draft=False)
        # This rank's tuned projection kernels (the daemon's, or tune now); drafts skip it, as upstream.
        autotune.prepare_engine(self.cfg, self.model, self.spec.get("enable_autotune", True))
        d = self.draft_spec
        if d:
            dcfg = EngineConfig.build(d["model"], self.spec["dtype"], None, self.spec["device"], ranks=self.ranks,
                                      revision=self.spec.get("revision"))
            dfmt = fmt if d["cached"] or fmt != "ipc_cache" else "auto"
            if dfmt != fmt:
                log.info("The %s draft is not cached (only %s drafts are); loading it from disk", d["method"],
                         ", ".join(CACHED_DRAFT_METHODS))
            self.draft = self._load(dcfg, dfmt, lc, draft=True)
        if self.world > 1:
            dist.barrier()  # every rank has its weights before rank 0 reports ready

    def _load(self, cfg: EngineConfig, fmt: str, lc, draft: bool) -> Llama:
        weights, report = load_weights(cfg, fmt, lc, draft=draft)
        self.reports.append(report)
        model = bind_weights(build_meta_model(cfg.shape, cfg.quant, cfg.dtype), weights.bindable())
        if self.tp > 1:
            model.set_all_reduce(self._all_reduce)
        r = self.ranks
        log.info("Rank %d (tp %d/%d, pp %d/%d, local rank %d) loaded %d %stensors (%.1f MiB) from %s in %.3f s",
                 self.rank, r.tp_rank, r.tp_size, r.pp_rank, r.pp_size, r.local_rank, report.tensors,
                 "draft " if draft else "", report.nbytes / 2**20, report.source, report.seconds)
        return model

    def _all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(t, group=self.tp_group)
        return t

    def close(self) -> None:
        for report in self.reports:
            for lease in report.keepalive:  # zero_copy: tell the daemons we no longer map their memory
                lease.close()
            report.keepalive.clear()

    # -- the request channel (rank 0 sends, the others receive) ------------------------------
    def send_request(self, op: int, prompt: list[int] = (), max_tokens: int = 0) -> None:
        if self.world == 1:
            return
        dist.broadcast(torch.tensor([op, len(prompt), max_tokens], dtype=torch.long, device=self.device), 0)
        if op == OP_GENERATE:
            dist.broadcast(torch.tensor(list(prompt), dtype=torch.long, device=self.device), 0)

    def recv_request(self) -> tuple[int, list[int], int]:
        header = torch.empty(3, dtype=torch.long, device=self.device)
        dist.broadcast(header, 0)
        op, n, max_tokens = header.tolist()
        prompt: list[int] = []
        if op == OP_GENERATE:
            ids = torch.empty(n, dtype=torch.long, device=self.device)
            dist.broadcast(ids, 0)
            prompt = ids.tolist()
        return op, prompt, max_tokens

    # -- one forward pass over the whole engine ----------------------------------------------
    def forward(self, model: Llama, cache, tokens: list[int], start: int, logits_from: int | None = None):
        """Logits (float32) on every rank: of the last position, or of positions ``logits_from``
        onwards. Stages pass hidden states down the pipeline; the last stage broadcasts."""
        s = model.shape
        T = len(tokens)
        if s.first_stage:
            x = torch.tensor(tokens, dtype=torch.long, device=self.device)
        else:
            x = torch.empty(T, s.hidden_size, dtype=model.dtype, device=self.device)
            dist.recv(x, src=self.rank - self.tp)
        out = model(x, start, cache, all_positions=logits_from is not None)
        if not s.last_stage:
            dist.send(out.contiguous(), dst=self.rank + self.tp)
            shape = (T - logits_from, s.vocab_size) if logits_from is not None else (s.vocab_size,)
            logits = torch.empty(shape, dtype=torch.float32, device=self.device)
        else:
            logits = (out[logits_from:] if logits_from is not None else out).contiguous()
        if self.world > 1:
            dist.broadcast(logits, src=(self.pp - 1) * self.tp)
        if self.trace is not None:
            self.trace.append(logits.clone())
        return logits

    @torch.inference_mode()
    def decode(self, prompt: list[int], max_tokens: int, eos: int | None) -> list[int]:
        if self.draft is None:
            return self._greedy(prompt, max_tokens, eos)
        return self._speculative(prompt, max_tokens, eos)

    def _greedy(self, prompt: list[int], max_tokens: int, eos: int | None) -> list[int]:
        cache = self.model.new_cache(len(prompt) + max_tokens)
        tokens, start, out = list(prompt), 0, []
        for _ in range(max_tokens):
            logits = self.forward(self.model, cache, tokens, start)
            start += len(tokens)
            nxt = int(torch.argmax(logits))
            out.append(nxt)
            if nxt == eos:
                break
            tokens = [nxt]
        return out

    def _speculative(self, prompt: list[int], max_tokens: int, eos: int | None) -> list[int]:
        k = self.draft_spec["k"]
        size = len(prompt) + max_tokens + k + 1
        tcache, dcache = self.model.new_cache(size), self.draft.new_cache(size)
        committed, out = list(prompt), []
        t_len = d_len = 0  # positions of each KV cache that hold committed tokens
        while True:
            feed, proposals = committed[d_len:], []
            for _ in range(k):
                logits = self.forward(self.draft, dcache, feed, d_len)
                d_len += len(feed)
                feed = [int(torch.argmax(logits))]
                proposals.append(feed[0])
            pending = committed[t_len:]
            # One target pass scores every proposal: logits at the last committed token and after each proposal.
            preds = self.forward(self.model, tcache, pending + proposals, t_len,
                                 logits_from=len(pending) - 1).argmax(dim=-1).tolist()
            accepted = 0
            while accepted < k and preds[accepted] == proposals[accepted]:
                accepted += 1
            self.proposed += k
            self.accepted += accepted
            t_len += len(pending) + accepted
            d_len = len(committed) + min(accepted, k - 1)
            new = proposals[:accepted] + [preds[accepted]]
            committed += new
            for tok in new:
                out.append(tok)
                if tok == eos or len(out) == max_tokens:
                    return out


def serve_requests(runner: RankRunner) -> int:
    """A non-driving rank: run every request rank 0 broadcasts, until it says stop."""
    try:
        while True:
            op, prompt, max_tokens = runner.recv_request()
            if op == OP_STOP:
                log.info("Engine rank %d stopping", runner.rank)
                return 0
            if op == OP_GENERATE:
                runner.decode(prompt, max_tokens, tokenizer.EOS_ID)
    except RuntimeError as e:
        log.error(LOST_PEERS.format(rank=runner.rank, error=str(e).splitlines()[0]))
        return 1
    finally:
        runner.close()


class ParallelEngine:
    """Engine rank 0: what the HTTP server calls; it drives every other rank."""

    def __init__(self, runner: RankRunner, max_model_len: int | None = None):
        self.runner = runner
        self.cfg = runner.cfg
        self.report = runner.reports[0]
        self.max_model_len = min(max_model_len or 2048, runner.cfg.shape.max_positions)
        self._lock = threading.Lock()
        self._last = time.monotonic()
        self.closed = False
        if runner.world > 1:
            threading.Thread(target=self._keepalive, daemon=True).start()

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

    def complete(self, prompt: str, max_tokens: int) -> tuple[str, list[int], str, int]:
        ids = tokenizer.encode(prompt)
        with self._lock:
            before = (self.runner.proposed, self.runner.accepted)
            self.runner.send_request(OP_GENERATE, ids, max_tokens)
            out = self.runner.decode(ids, max_tokens, tokenizer.EOS_ID)
            self._last = time.monotonic()
        if self.runner.draft is not None:
            log.info("Speculative decoding (%s): accepted %d of %d draft tokens", self.runner.draft_spec["method"],
                     self.runner.accepted - before[1], self.runner.proposed - before[0])
        finish = "stop" if out and out[-1] == tokenizer.EOS_ID else "length"
        return tokenizer.decode(out), out, finish, len(ids)

    def close(self) -> None:
        with self._lock:
            if self.closed:
                return
            self.closed = True
            try:
                self.runner.send_request(OP_STOP)
            except RuntimeError:
                pass
        self.runner.close()


# -- processes --------------------------------------------------------------------------------
def spawn_worker(spec: dict) -> subprocess.Popen:
    env = dict(os.environ, **{SPEC_ENV: json.dumps({**spec, "parent_pid": os.getpid()})})
    return subprocess.Popen([sys.executable, "-m", "wcache.engine.workers"], env=env)


def stop_workers(procs: list[subprocess.Popen], grace_s: float = STOP_GRACE_S) -> None:
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.terminate()
    for p in procs:
        try:
            p.wait(timeout=5)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


class WorkerMonitor(threading.Thread):
    """Watches this node's worker processes. A worker that dies while the engine starts takes the
    serve process down (it may be blocked in a collective that would wait for the dead rank); one
    that dies later turns /health to 503."""

    def __init__(self, procs: list[subprocess.Popen], server=None):
        super().__init__(daemon=True)
        self.procs, self.server = procs, server
        self.started_ok = False
        self.stopping = False

    def run(self) -> None:
        while self.procs and not self.stopping:
            time.sleep(0.2)
            dead = {i + 1: p.returncode for i, p in enumerate(self.procs) if p.poll() is not None}
            if not dead or self.stopping:
                continue
            if not self.started_ok:
                log.error(WORKERS_STARTUP_FAILED.format(codes=dead))
                for p in self.procs:
                    if p.poll() is None:
                        p.terminate()
                code = next((c for c in dead.values() if c), 1)
                logging.shutdown()
                os._exit(code if code > 0 else 1)
            if self.server is not None:
                self.server.ready = False
            log.error(WORKERS_EXITED.format(codes=dead))
            return


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
        draft = {"method": sc.method, "model": sc.model, "k": sc.num_speculative_tokens, "cached": sc.cached}
    common = {
        "model": args.model, "dtype": args.dtype, "quantization": args.quantization, "device": base.device,
        "revision": args.revision, "load_format": args.load_format, "loader_config": asdict(loader_config),
        "init_method": plan.init_method, "backend": "nccl" if base.device == "cuda" else "gloo",
        "draft": draft, "enable_autotune": getattr(args, "enable_autotune", True),
        "log_level": logging.getLevelName(logging.getLogger().level),
    }
    return plan, [{**common, "ranks": asdict(r)} for r in plan.local]


def run_serve(args, loader_config) -> int:
    """``wcache serve`` for a multi-rank engine (see ranks.needs_workers)."""
    from wcache.engine.server import EngineServer, run_until_signal

    plan, specs = rank_specs(args, loader_config)
    log.info("Engine for data-parallel rank %d: %s; %d rank(s) here, engine world of %d at %s", plan.dp_rank,
             plan.layout.describe(), len(specs), plan.world_size, plan.init_method)
    server = None
    if plan.drives:
        # Listen before loading so /health answers 503 while weights load (readiness probes).
        server = EngineServer((args.host, args.port), None, args.model)
        log.info("Serving on http://%s:%d (health 503 until every rank has its weights)", args.host, args.port)
    workers = [spawn_worker(s) for s in specs[1:]]
    monitor = WorkerMonitor(workers, server)
    monitor.start()
    runner = RankRunner(specs[0])
    try:
        runner.join()
        runner.load()
    except BaseException:
        monitor.stopping = True
        for p in workers:
            p.terminate()
        stop_workers(workers)
        if server is not None:
            server.server_close()
        raise
    monitor.started_ok = True
    if not plan.drives:
        log.info("Engine node %d ready: %d rank(s) follow engine rank 0 at %s", plan.layout.node_rank,
                 len(specs), plan.init_method)
        code = serve_requests(runner)
        monitor.stopping = True
        stop_workers(workers)
        exit_after_collectives(code)
    engine = ParallelEngine(runner, args.max_model_len)

    def on_stop() -> None:
        monitor.stopping = True
        engine.close()
        stop_workers(workers)

    server.engine, server.ready = engine, True
    log.info("Engine ready: POST http://%s:%d/v1/completions", args.host, args.port)
    run_until_signal(server, on_stop=on_stop)
    log.info("Engine stopped")
    exit_after_collectives(0)


def _die_with_parent(parent_pid: int | None) -> None:
    """Linux: get SIGTERM when the serve process dies, so no worker outlives its engine."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if parent_pid is not None and os.getppid() != parent_pid:
        sys.exit(1)  # the parent died before we asked


def main() -> int:
    spec = json.loads(os.environ[SPEC_ENV])
    logs.setup(spec.get("log_level", "INFO"))
    _die_with_parent(spec.get("parent_pid"))
    runner = RankRunner(spec)
    try:
        runner.join()
        runner.load()
    except UserError as e:
        log.error("%s", e)
        return 2
    except RuntimeError as e:  # a peer died during startup
        log.error(LOST_PEERS.format(rank=runner.rank, error=str(e).splitlines()[0]))
        return 1
    exit_after_collectives(serve_requests(runner))


if __name__ == "__main__":
    sys.exit(main())
