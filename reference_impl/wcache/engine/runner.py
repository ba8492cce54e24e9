"""One engine rank, for an engine of any world size: its models, its memory plan, its decoding loop.

A world of one rank is the plain engine (``wcache serve`` without parallel flags). With several
ranks, each is one process (``engine/supervisor.py`` starts ranks 1..N-1 as
``python -m wcache.engine.runner`` with their settings as JSON in the environment). Each rank
loads exactly its own shard, from disk or from its own daemon socket (the ipc_cache loader picks
the socket from the rank's local rank), then all ranks of the engine meet in one world on
``--master-addr``/``--master-port`` (gloo on CPU, nccl on CUDA).

Every rank sizes its own KV cache from its own memory budget (memory.py); the ranks then agree on
the least of their lengths, so the engine's ``max_model_len`` fits every rank.

The computation is SPMD: engine rank 0 serves HTTP (engine.py) and, for each request, broadcasts a
small int64 header and the prompt's token ids; every rank then runs the same decoding loop.
Tensor-parallel ranks all-reduce the two row-parallel projections of every layer
(``Llama.set_all_reduce``); pipeline stages hand hidden states to the next stage with send/recv;
the last stage broadcasts the logits, so every rank takes the same decision: greedy, or the same
seeded draw (sampling.py; the settings travel in the request header). Where rank 0 may end a
sequence early (a stop string, a streaming client gone) it tells the others after every token.
Nothing but tensors crosses between ranks (no pickle).

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
import sys
import threading
from dataclasses import asdict, dataclass, field

import torch

from wcache import logs
from wcache.core import autotune
from wcache.core.config import EngineConfig, Ranks
from wcache.core.distributed import exit_after_collectives
from wcache.core.speculative import CACHED_DRAFT_METHODS
from wcache.engine import memory
from wcache.engine.loading.base import LoadedWeights
from wcache.engine.loading.config import LoaderConfig
from wcache.engine.loading.registry import load_weights
from wcache.engine.sampling import GREEDY, Sampler, SamplingParams
from wcache.engine.world import LOST_PEERS, World
from wcache.errors import UserError
from wcache.model import tokenizer
from wcache.model.llama import Llama, bind_weights, build_meta_model
from wcache.wire.handback import withdraw_offers

log = logging.getLogger("wcache.engine")

SPEC_ENV = "WCACHE_WORKER_SPEC"
OP_GENERATE, OP_STOP, OP_KEEPALIVE = 1, 2, 3
DEFAULT_MAX_MODEL_LEN = 2048
WARM_UP_TOKENS = 8  # a hot spare's warm-up prefill (runner.warm_up)


@dataclass(frozen=True)
class EngineOptions:
    """The engine's settings beyond the model configuration: the same on every rank."""

    load_format: str = "auto"
    loader_config: LoaderConfig = field(default_factory=LoaderConfig)
    max_model_len: int | None = None
    gpu_memory_utilization: float = memory.DEFAULT_UTILIZATION
    cpu_memory_capacity: int | None = None
    enable_autotune: bool = True
    draft: dict | None = None  # {"method", "model", "k", "cached"} of --speculative-config
    init_method: str | None = None  # the engine world's rendezvous (tcp://addr:port)
    backend: str = "gloo"

    def as_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> EngineOptions:
        return cls(**{**d, "loader_config": LoaderConfig(**d["loader_config"])})


def rank_spec(cfg_fields: dict, ranks: Ranks, options: EngineOptions) -> dict:
    """What a rank process needs, as JSON: the model flags, its place, the engine's options."""
    return {**cfg_fields, "ranks": asdict(ranks), "options": options.as_json(),
            "log_level": logging.getLevelName(logging.getLogger().level)}


class RankRunner:
    """One engine rank: its models, its KV caches, and its place in the world."""

    def __init__(self, cfg: EngineConfig, options: EngineOptions | None = None):
        self.cfg, self.options = cfg, options or EngineOptions()
        options = self.options
        self.ranks = cfg.ranks
        self.world = World(cfg.ranks, options.backend, options.init_method)
        self.rank = self.world.rank
        self.device = cfg.torch_device
        self.draft_spec = options.draft
        # The plain engine (one rank, no draft) logs as it always has; any other logs its rank.
        self.plain = cfg.ranks.world_size == 1 and options.draft is None
        self.model: Llama | None = None
        self.draft: Llama | None = None
        self.loads: list[LoadedWeights] = []
        self.memory: memory.MemoryPlan | None = None
        self.max_model_len = 0
        self.kv_cache = self.draft_cache = None
        self.proposed = self.accepted = 0
        self.spare_reserve = 0  # --respawn: device bytes the waiting spare holds (memory.MemoryPlan)
        self.trace: list | None = None  # set to a list to record every forward pass's logits (tests)

    @classmethod
    def from_spec(cls, spec: dict) -> RankRunner:
        return cls(EngineConfig.from_spec(spec), EngineOptions.from_json(spec["options"]))

    @property
    def report(self):
        """The target model's load report."""
        return self.loads[0].report

    # -- startup -----------------------------------------------------------------------------
    def start(self) -> None:
        """Join the world, load, size memory; on any failure let go of what was leased."""
        try:
            self.world.join()
            self.load()
        except BaseException:
            self.close()
            raise

    def load(self) -> None:
        self.load_models()
        self._size_memory()
        self.world.barrier()  # every rank has its weights and KV cache before rank 0 reports ready

    # -- a hot --respawn spare (engine/spare.py): everything but the KV cache before promotion ----
    def prepare(self) -> None:
        """Join, load (zero_copy: map the daemon's arena again) and tune, then run a warm-up forward
        so kernels and libraries are loaded; no KV cache is kept. ``finish()`` sizes and allocates it."""
        try:
            self.world.join()
            self.load_models()
            self.warm_up()
        except BaseException:
            self.close()
            raise

    def finish(self) -> None:
        """A prepared rank (``prepare``): size memory and allocate the KV cache; no weight is read."""
        try:
            self._size_memory()
            self.world.barrier()
        except BaseException:
            self.close()
            raise

    @torch.inference_mode()
    def warm_up(self) -> None:
        """A prefill of a few tokens and one decode step on every model, on a throw-away cache: the
        first forward loads kernels, libraries and workspaces (cuBLAS: ~0.2 s and ~130 MiB on an
        H200), which a spare pays while it waits instead of in its first answer."""
        for m in (self.model, self.draft):
            if m is None:
                continue
            cache = m.new_cache(WARM_UP_TOKENS + 1)
            m(torch.zeros(WARM_UP_TOKENS, dtype=torch.long, device=self.device), 0, cache)
            m(torch.zeros(1, dtype=torch.long, device=self.device), WARM_UP_TOKENS, cache)
            del cache
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def load_models(self) -> None:
        """The models' weights and their tuned kernels, with nothing sized yet."""
        o = self.options
        self.model = self._load(self.cfg, o.load_format, draft=False)
        # This rank's tuned projection kernels (the daemon's, or tune now); drafts skip it, as upstream.
        # Tune before sizing memory: the profiling forward then measures the activations of the winners.
        self.autotune = autotune.prepare_engine(self.cfg, self.model, o.enable_autotune)
        d = self.draft_spec
        if d:
            dcfg = EngineConfig.build(d["model"], d.get("dtype", "auto"), None, self.cfg.device, ranks=self.ranks,
                                      revision=self.cfg.revision)
            dfmt = o.load_format if d["cached"] or o.load_format != "ipc_cache" else "auto"
            if dfmt != o.load_format:
                log.info("The %s draft is not cached (only %s drafts are); loading it from disk", d["method"],
                         ", ".join(CACHED_DRAFT_METHODS))
            self.draft = self._load(dcfg, dfmt, draft=True)
        for loaded in self.loads:  # copy mode: the daemon's memory is free before ours is planned
            loaded.settle()

    def _load(self, cfg: EngineConfig, fmt: str, draft: bool) -> Llama:
        loaded = load_weights(cfg, fmt, self.options.loader_config, draft=draft)
        self.loads.append(loaded)
        report = loaded.report
        model = bind_weights(build_meta_model(cfg.shape, cfg.quant, cfg.dtype), loaded.weights.bindable())
        if self.world.tp > 1:
            model.set_all_reduce(self.world.all_reduce_tp)
        if self.plain:
            log.info("Loaded %d tensors (%.1f MiB) from %s in %.3f s", report.tensors, report.nbytes / 2**20,
                     report.source, report.seconds)
        else:
            r = self.ranks
            log.info("Rank %d (tp %d/%d, pp %d/%d, local rank %d) loaded %d %stensors (%.1f MiB) from %s in %.3f s",
                     self.rank, r.tp_rank, r.tp_size, r.pp_rank, r.pp_size, r.local_rank, report.tensors,
                     "draft " if draft else "", report.nbytes / 2**20, report.source, report.seconds)
        return model

    def _size_memory(self) -> None:
        """Split this rank's budget (memory.py), agree with the other ranks on the longest sequence,
        and allocate the KV cache(s) for it."""
        o, cfg = self.options, self.cfg
        external = sum(memory.external_weights(ld.lease) for ld in self.loads)  # the daemons' own count
        capacity = memory.device_capacity(self.device, o.cpu_memory_capacity)
        memory.check_external(capacity, o.gpu_memory_utilization, external, self.device.type)
        models = [m for m in (self.model, self.draft) if m is not None]
        want = min(o.max_model_len or DEFAULT_MAX_MODEL_LEN, cfg.shape.max_positions)
        lookahead = self.draft_spec["k"] + 1 if self.draft_spec else 0  # speculative positions past the output
        plan = self.memory = memory.MemoryPlan(
            device=cfg.device, capacity=capacity, utilization=o.gpu_memory_utilization,
            own_weights=sum(ld.report.nbytes - ld.report.external_bytes for ld in self.loads),
            external_weights=external,
            activation_peak=max(memory.measure_activation_peak(m, want + lookahead) for m in models),
            spare_reserve=self.spare_reserve,
            kv_bytes_per_token=sum(memory.kv_bytes_per_token(m.shape, m.dtype) for m in models))
        if external:
            log.info(memory.HELD_OUTSIDE.format(external=memory.format_bytes(external), split=plan.split()))
        else:
            log.info(memory.BUDGET.format(split=plan.split()))
        log.info(memory.PLAN_JSON.format(json=plan.as_json()))
        tokens = self.world.least(plan.kv_tokens) - lookahead  # every rank must hold the engine's length
        self.max_model_len = memory.size_max_model_len(plan, o.max_model_len, DEFAULT_MAX_MODEL_LEN,
                                                       cfg.shape.max_positions, tokens=tokens)
        size = self.max_model_len + lookahead
        self.kv_cache = self.model.new_cache(size)  # one sequence at a time reuses it
        if self.draft is not None:
            self.draft_cache = self.draft.new_cache(size)
        log.info(memory.KV_ALLOCATED.format(tokens=size, size=memory.format_bytes(size * plan.kv_bytes_per_token),
                                            length=self.max_model_len, budget=plan.kv_tokens))

    def close(self) -> None:
        """Let go of every lease: zero_copy tells the daemons we no longer map their memory."""
        for loaded in self.loads:
            loaded.close()

    # -- the request channel (rank 0 sends, the others receive) ------------------------------
    def send_request(self, op: int, prompt: list[int] = (), max_tokens: int = 0, sampling: SamplingParams = GREEDY,
                     stops: bool = False) -> None:
        self.world.send_request(op, prompt, max_tokens, with_prompt=op == OP_GENERATE, sampling=sampling.as_ints(),
                                stops=stops)

    def recv_request(self) -> tuple[int, list[int], int, SamplingParams, bool]:
        op, prompt, max_tokens, sampling, stops = self.world.recv_request(lambda op: op == OP_GENERATE)
        return op, prompt, max_tokens, SamplingParams.from_ints(sampling), stops

    # -- one forward pass over the whole engine ----------------------------------------------
    def forward(self, model: Llama, cache, tokens: list[int], start: int, logits_from: int | None = None):
        """Logits (float32) on every rank: of the last position, or of positions ``logits_from``
        onwards. Stages pass hidden states down the pipeline; the last stage broadcasts."""
        s = model.shape
        T = len(tokens)
        if s.first_stage:
            x = torch.tensor(tokens, dtype=torch.long, device=self.device)
        else:
            x = self.world.recv_hidden((T, s.hidden_size), model.dtype, self.device)
        out = model(x, start, cache, all_positions=logits_from is not None)
        if not s.last_stage:
            self.world.send_hidden(out)
            shape = (T - logits_from, s.vocab_size) if logits_from is not None else (s.vocab_size,)
            logits = torch.empty(shape, dtype=torch.float32, device=self.device)
        else:
            logits = (out[logits_from:] if logits_from is not None else out).contiguous()
        self.world.broadcast_logits(logits)
        if self.trace is not None:
            self.trace.append(logits.clone())
        return logits

    # -- the decoding loop: greedy or sampled, with or without a draft ---------------------------
    @torch.inference_mode()
    def decode(self, prompt: list[int], max_tokens: int, eos: int | None, sampling: SamplingParams = GREEDY,
               on_token=None, stops: bool = False) -> list[int]:
        """Tokens after ``prompt``. Without a draft every step proposes nothing and the target alone
        picks the next token (sampling.py); with one (greedy only), each step verifies ``k`` draft
        tokens at once. ``on_token(token) -> bool`` (rank 0) is told each token and may stop the
        sequence; with ``stops`` every rank asks rank 0 after each token whether it did."""
        if max_tokens < 1:
            return []
        sampler = Sampler(sampling)
        k = self.draft_spec["k"] if self.draft is not None else 0
        committed, out = list(prompt), []
        t_len = d_len = 0  # positions of each KV cache that hold committed tokens
        while True:
            proposals = []
            if k:
                feed = committed[d_len:]
                for _ in range(k):
                    logits = self.forward(self.draft, self.draft_cache, feed, d_len)
                    d_len += len(feed)
                    feed = [int(torch.argmax(logits))]
                    proposals.append(feed[0])
            pending = committed[t_len:]
            # One target pass scores every proposal: logits at the last committed token and after each proposal.
            if k:
                preds = self.forward(self.model, self.kv_cache, pending + proposals, t_len,
                                     logits_from=len(pending) - 1).argmax(dim=-1).tolist()
            else:
                preds = [sampler.pick(self.forward(self.model, self.kv_cache, pending, t_len))]
            accepted = 0
            while accepted < k and preds[accepted] == proposals[accepted]:
                accepted += 1
            self.proposed += k
            self.accepted += accepted
            t_len += len(pending) + accepted
            d_len = len(committed) + min(accepted, max(k - 1, 0))
            new = proposals[:accepted] + [preds[accepted]]
            committed += new
            for tok in new:
                out.append(tok)
                stop = on_token(tok) if on_token is not None else False
                if stops:
                    stop = self.world.share_flag(stop)
                if stop or tok == eos or len(out) == max_tokens:
                    return out


def serve_requests(runner: RankRunner) -> int:
    """A non-driving rank: run every request rank 0 broadcasts, until it says stop."""
    try:
        while True:
            op, prompt, max_tokens, sampling, stops = runner.recv_request()
            if op == OP_STOP:
                log.info("Engine rank %d stopping", runner.rank)
                return 0
            if op == OP_GENERATE:
                runner.decode(prompt, max_tokens, tokenizer.EOS_ID, sampling, stops=stops)
    except RuntimeError as e:
        log.error(LOST_PEERS.format(rank=runner.rank, error=str(e).splitlines()[0]))
        return 1
    finally:
        runner.close()


def die_with_parent(parent_pid: int | None) -> None:
    """Linux: get SIGTERM when the serve process dies, so no worker outlives its engine."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if parent_pid is not None and os.getppid() != parent_pid:
        sys.exit(1)  # the parent died before we asked


def withdraw_offers_on_sigterm() -> None:
    """SIGTERM (the supervisor's stop, or the serve process's death through PDEATHSIG) still ends a
    worker at once, as before, but first removes its hand-back offers (wire/handback.py): a worker
    whose daemon went away before it offers its arena in the socket directory, and the default
    action would leave that socket behind. A Python handler cannot do it: the worker's main thread
    waits inside collectives, where none runs. The C-level handler writes the signal's number to a
    pipe (signal.set_wakeup_fd) whatever the main thread is doing, and a thread reading it withdraws
    the offers, restores the default action and raises the signal again."""
    r, w = os.pipe()
    os.set_blocking(w, False)
    signal.set_wakeup_fd(w)
    signal.signal(signal.SIGTERM, lambda _signum, _frame: None)  # the pipe's reader acts on it

    def watch() -> None:
        while os.read(r, 1)[0] != signal.SIGTERM:  # other handled signals (SIGINT) keep their handlers
            pass
        withdraw_offers()
        libc = ctypes.CDLL(None, use_errno=True)
        libc.signal(signal.SIGTERM, 0)  # SIG_DFL, from this thread (signal.signal only runs in the main one)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="wcache-sigterm", daemon=True).start()


def main() -> int:
    """A rank process started by the supervisor: start, then follow rank 0's requests."""
    spec = json.loads(os.environ[SPEC_ENV])
    logs.setup(spec.get("log_level", "INFO"))
    withdraw_offers_on_sigterm()
    die_with_parent(spec.get("parent_pid"))
    try:
        runner = RankRunner.from_spec(spec)
        runner.start()
    except UserError as e:
        log.error("%s", e)
        exit_after_collectives(2)  # gloo's teardown must not turn a clear exit 2 into SIGABRT
    except RuntimeError as e:  # a peer died during startup
        log.error(LOST_PEERS.format(rank=Ranks(**spec["ranks"]).global_rank, error=str(e).splitlines()[0]))
        exit_after_collectives(1)
    exit_after_collectives(serve_requests(runner))


if __name__ == "__main__":
    sys.exit(main())
