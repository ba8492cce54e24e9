"""One engine rank, for an engine of any world size: its models, its memory plan, its decoding loop.

A world of one rank is the plain engine (``wcache serve`` without parallel flags). With several
ranks, each is one process (``engine/worker/supervisor.py`` starts ranks 1..N-1 as
``python -m wcache.engine.worker.runner`` with their settings as JSON in the environment). Each rank
loads exactly its own shard, from disk or from its own daemon socket (the ipc_cache loader picks
the socket from the rank's local rank), then all ranks of the engine meet in one world on
``--master-addr``/``--master-port`` (gloo on CPU, nccl on CUDA).

Every rank sizes its own KV cache from its own memory budget (memory.py); the ranks then agree on
the least of their lengths, so the engine's ``max_model_len`` fits every rank.

The computation is SPMD, one forward pass at a time: engine rank 0 decides every pass (the
scheduler, scheduler.py, picks the batch; engine.py samples, checks stops and streams) and, before
each, broadcasts one fixed-length int64 header saying which model runs over which rows: the
rows' KV cache slots, their start positions and their new tokens. Every other rank runs exactly
that pass (``follow``), so the ranks stay in lockstep with nothing to decide of their own.
Tensor-parallel ranks all-reduce the two row-parallel projections of every layer
(``Llama.set_all_reduce``); pipeline stages hand hidden states to the next stage with send/recv;
the last stage's first rank sends the logits to rank 0, the only rank that samples (the token it
picks reaches the others in the next header). Nothing but tensors crosses between ranks (no pickle).

Each rank's KV cache holds ``num_seqs`` slots of ``max_model_len`` positions (memory.py sizes it:
``--max-num-seqs`` at most, as many as the budget holds); a running sequence owns one slot.

With ``--speculative-config`` every rank also holds its shard of a draft model (from the draft
daemon group's ``_draft`` sockets when the method is cached); decoding is then greedy
draft-then-verify, one sequence at a time (one slot): the draft proposes ``num_speculative_tokens``
tokens, the target scores them in one forward pass, and the longest agreeing prefix plus the
target's own next token is kept. The output is the target's greedy output.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import signal
import sys
import threading
import time
from dataclasses import asdict, dataclass, field

import torch

from wcache import logs
from wcache.core import autotune, no_dump
from wcache.core.config import EngineConfig, Ranks
from wcache.core.distributed import exit_after_collectives
from wcache.core.speculative import CACHED_DRAFT_METHODS
from wcache.engine.worker import gpu_steps, memory
from wcache.engine.worker.loop_thread import LoopThread
from wcache.engine.worker.gpu_steps import GpuSteps
from wcache.engine.loading.base import LoadedWeights
from wcache.engine.loading.config import LoaderConfig
from wcache.engine.loading.registry import load_weights
from wcache.engine.worker.sampling import GREEDY, Sampler, SamplingParams
from wcache.engine.worker.world import LOST_PEERS, World
from wcache.errors import UserError
from wcache.model.llama import Llama, bind_weights, build_meta_model
from wcache.wire.handback import withdraw_offers

log = logging.getLogger("wcache.engine")

SPEC_ENV = "WCACHE_WORKER_SPEC"
OP_FORWARD, OP_STOP, OP_KEEPALIVE = 1, 2, 3
TARGET, DRAFT = 0, 1  # which model a forward pass runs
HEADER_FIXED = 5  # op, model, rows, tokens per row, logits_from; then slots, starts and tokens
DEFAULT_MAX_MODEL_LEN = 2048
ROWS_WARMED = "Built the CPU matrix kernels for passes of up to {most} rows in {seconds:.2f} s"
WARM_UP_TOKENS = 8  # a hot spare's warm-up prefill (runner.warm_up)
# vLLM's default (its V1 engine picks 256 or 1024 by hardware). Every slot holds a whole
# --max-model-len, so the KV cache for 256 slots is allocated at start; memory.py lowers it to what
# the budget holds. tiny: 256 x 512 tokens x 1 KiB = 128 MiB; llama-8b: 256 x 2048 x 128 KiB = 64 GiB.
DEFAULT_MAX_NUM_SEQS = 256
# Requests that may wait for a slot; past it a 503 with Retry-After (vLLM's queue has no bound). Every
# waiting request holds an HTTP connection, so this only bites once slots are few (a small KV
# budget, a speculative engine's single slot) or the front door allows more connections.
DEFAULT_MAX_WAITING_REQUESTS = 128


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
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS  # sequences decoded together (--max-num-seqs)
    max_waiting_requests: int = DEFAULT_MAX_WAITING_REQUESTS  # queued beyond them; then 503 (rank 0)
    enforce_eager: bool = False  # GPU decode tiles without CUDA graphs (--enforce-eager)

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
        self.gpu: GpuSteps | None = None  # GPU, one rank, no draft: passes as CUDA graphs
        self.num_seqs = 1  # KV cache slots: sequences that run at once
        self.header_len = HEADER_FIXED
        self.proposed = self.accepted = 0
        self.spare_reserve = 0  # --respawn: device bytes the waiting spare holds (memory.MemoryPlan)
        self.graph_pool: int | None = None  # device bytes the decode graphs hold (memory.MemoryPlan)
        self.trace: list | None = None  # set to a list to record every forward pass's logits (tests)
        self.thread: LoopThread | None = None  # a spare's warm-up, then the engine loop (loop_thread.py)

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

    # -- a hot --respawn spare (engine/respawn/spare.py): everything but the KV cache before promotion ----
    def prepare(self, mark=None) -> None:
        """Join, load (zero_copy: map the daemon's arena again) and tune, then run a warm-up forward
        so kernels and libraries are loaded; no KV cache is kept. ``finish()`` sizes and allocates it.
        ``mark(phase)``, if given, is called after each phase (weights, warm_up, graphs): a spare
        measures its reserve phase by phase (engine/respawn/spare.py)."""
        mark = mark or (lambda phase: None)
        try:
            self.world.join()
            self.load_models()
            mark("weights")
            self.warm_up(mark)
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

    def warm_up(self, mark=None) -> None:
        """A prefill of a few tokens and one decode step on every model, on a throw-away cache: the
        first forward loads kernels, libraries and workspaces (cuBLAS: ~0.2 s and ~130 MiB on an
        H200), which a spare pays while it waits instead of in its first answer. On the thread that
        will run the engine loop, whose per-thread library state it warms too (loop_thread.py)."""
        if self.thread is None:
            self.thread = LoopThread()
        self.thread.call(lambda: self._warm_up(mark or (lambda phase: None)))

    @torch.inference_mode()
    def _warm_up(self, mark) -> None:
        for m in (self.model, self.draft):
            if m is None:
                continue
            cache = m.new_cache(WARM_UP_TOKENS + 1)
            m(torch.zeros(WARM_UP_TOKENS, dtype=torch.long, device=self.device), 0, cache)
            m(torch.zeros(1, dtype=torch.long, device=self.device), WARM_UP_TOKENS, cache)
            del cache
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            # The throw-away caches and activations go back to the device: the serving worker's plan
            # counts this process's reserve, and blocks torch merely keeps cached would be counted too.
            torch.cuda.empty_cache()
        mark("warm_up")
        if self.tiled:  # the graphs' passes too, measured now rather than at promotion
            self._graph_pool(min(self.options.max_model_len or DEFAULT_MAX_MODEL_LEN, self.cfg.shape.max_positions))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        mark("graphs")

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
        self._warm_rows()

    def _warm_rows(self) -> None:
        """CPU, bfloat16: the projections' kernels for the padded row counts a pass can have
        (llama.padded_rows), built now rather than by the first pass of each count. Before sizing
        memory, so that its profiling forward runs padded."""
        o, t0 = self.options, time.perf_counter()
        lookahead = self.draft_spec["k"] + 1 if self.draft_spec else 0
        longest = min(o.max_model_len or DEFAULT_MAX_MODEL_LEN, self.cfg.shape.max_positions) + lookahead
        for m in (self.model, self.draft):
            if m is not None and self.device.type == "cpu" and m.dtype == torch.bfloat16:
                padded = m.warm_rows(max(longest, o.max_num_seqs), max(o.max_num_seqs, lookahead))
                log.info(ROWS_WARMED.format(most=padded, seconds=time.perf_counter() - t0))

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

    @property
    def tiled(self) -> bool:
        """Forward passes as CUDA graphs, decode steps in tiles of slots (engine/worker/gpu_steps.py): a GPU
        engine of one rank without a draft. Several ranks decode as one batch of the running rows."""
        return self.device.type == "cuda" and self.world.size == 1 and self.draft_spec is None

    def _graph_pool(self, slot_len: int) -> int:
        """The CUDA graphs' memory (0 unless tiled) for slots of at most ``slot_len`` positions; a
        spare measured it while it waited."""
        if self.graph_pool is None:
            self.graph_pool = (gpu_steps.pool_bytes(self.model, self.options.max_num_seqs, slot_len)
                               if self.tiled else 0)
        return self.graph_pool

    def _size_memory(self) -> None:
        """``_plan_memory``, with a CUDA out-of-memory on the way named as one line (exit 2)."""
        with memory.out_of_memory_named(self.device, self.options.gpu_memory_utilization,
                                        "sizing and allocating the KV cache"):
            self._plan_memory()

    def _plan_memory(self) -> None:
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
            graph_pool=self._graph_pool(want + lookahead),
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
        # A speculative engine decodes one sequence at a time (see engine.py): one slot.
        want_seqs = 1 if self.draft is not None else o.max_num_seqs
        self.num_seqs = memory.size_num_seqs(plan, self.max_model_len, size, want_seqs, tokens=tokens + lookahead)
        # What the plan will still allocate must be free: other processes' memory is outside the budget.
        own = torch.cuda.memory_reserved(self.device) if self.device.type == "cuda" else 0
        counted = external + self.spare_reserve + own
        memory.check_device_free(self.device, o.gpu_memory_utilization, counted,
                                 needed=self.num_seqs * size * plan.kv_bytes_per_token + plan.graph_pool
                                 + plan.activation_peak)
        self.kv_cache = self.model.new_cache(size, self.num_seqs)
        if self.tiled:
            self.gpu = GpuSteps(self.model, self.kv_cache, self.num_seqs, graphs=not o.enforce_eager)
        if self.draft is not None:
            self.draft_cache = self.draft.new_cache(size, self.num_seqs)
        # The longest header: one row of a whole sequence (a prefill), or one token of every slot.
        self.header_len = HEADER_FIXED + max(2 + size, 3 * self.num_seqs)
        log.info(memory.KV_ALLOCATED.format(
            seqs=self.num_seqs, tokens=size, size=memory.format_bytes(self.num_seqs * size * plan.kv_bytes_per_token),
            length=self.max_model_len, budget=plan.kv_tokens))

    def close(self) -> None:
        """Let go of every lease: zero_copy tells the daemons we no longer map their memory."""
        for loaded in self.loads:
            loaded.close()

    # -- one forward pass over the whole engine ----------------------------------------------
    def run(self, model: int, slots: list[int], starts: list[int], tokens: list[list[int]],
            logits_from: int | None = None) -> torch.Tensor:
        """Rank 0: tell every rank which pass to run, run it, and return its logits (float32): of
        each row's last position, (B, vocab), or of positions ``logits_from`` onwards, (B, T', vocab).
        Every row brings the same number of new tokens."""
        T = len(tokens[0])
        flat = [t for row in tokens for t in row]
        lf = -1 if logits_from is None else logits_from
        self.world.send_step([OP_FORWARD, model, len(slots), T, lf, *slots, *starts, *flat], self.header_len)
        return self.forward(model, slots, starts, flat, T, lf)

    def send_op(self, op: int) -> None:
        """Rank 0: OP_STOP or OP_KEEPALIVE to the other ranks."""
        self.world.send_step([op], self.header_len)

    def follow(self) -> int:
        """Any rank but 0: run each pass rank 0 announces; the op that ended it (OP_STOP)."""
        while True:
            h = self.world.recv_step(self.header_len)
            op = h[0]
            if op == OP_STOP:
                return op
            if op != OP_FORWARD:
                continue  # a keepalive
            model, B, T, lf = h[1:5]
            slots, starts = h[HEADER_FIXED : HEADER_FIXED + B], h[HEADER_FIXED + B : HEADER_FIXED + 2 * B]
            base = HEADER_FIXED + 2 * B
            self.forward(model, slots, starts, h[base : base + B * T], T, lf)

    @torch.inference_mode()
    def forward(self, model_id: int, slots: list[int], starts: list[int], tokens: list[int], T: int, lf: int):
        """This rank's part of one pass. Stages pass hidden states down the pipeline; the last
        stage's first rank sends the logits to rank 0. Returns the logits on rank 0, else None."""
        model, cache = (self.model, self.kv_cache) if model_id == TARGET else (self.draft, self.draft_cache)
        s, B = model.shape, len(slots)
        if self.gpu is not None and model_id == TARGET and lf < 0 and (logits := self._graphed(slots, starts, tokens, T)) is not None:
            if self.trace is not None:
                self.trace.append(logits.clone())
            return logits
        if s.first_stage:
            x = torch.tensor(tokens, dtype=torch.long, device=self.device).view(B, T)
        else:
            x = self.world.recv_hidden((B * T, s.hidden_size), model.dtype, self.device)
        out = model(x, starts, cache, all_positions=lf >= 0, slots=slots)
        logits = None
        if not s.last_stage:
            self.world.send_hidden(out)
            if self.rank == 0:
                shape = (B, T - lf, s.vocab_size) if lf >= 0 else (B, s.vocab_size)
                logits = self.world.recv_logits(shape, self.device)
        else:
            logits = out[:, lf:] if lf >= 0 else out
            if self.rank == self.world.logits_rank and self.rank != 0:
                self.world.send_logits(logits)
        if self.rank != 0:
            return None
        if self.trace is not None:
            self.trace.append(logits.clone())
        return logits

    def _graphed(self, slots: list[int], starts: list[int], tokens: list[int], T: int) -> torch.Tensor | None:
        """The pass through the CUDA graphs (gpu_steps): a decode step, or one prompt short enough."""
        if T == 1:
            return self.gpu.decode(slots, starts, tokens)
        if len(slots) == 1 and starts[0] == 0:
            return self.gpu.prompt(slots[0], tokens)
        return None

    def move_slot(self, old: int, new: int, length: int) -> None:
        """A world of one: a sequence's first ``length`` KV positions from slot ``old`` to ``new``
        (the scheduler keeps the running slots packed; the copy is exact, so its tokens stay)."""
        for k, v in self.kv_cache:
            k[new, :length] = k[old, :length]
            v[new, :length] = v[old, :length]

    # -- one sequence alone (tests, and the speculative engine's rounds) ------------------------
    def speculate(self, slot: int, committed: list[int], lens: list[int]) -> list[int]:
        """One greedy draft-then-verify round for the sequence ``committed`` (prompt and output so
        far) in ``slot``: the new tokens, 1 to k + 1 of them. ``lens`` = [target, draft] positions
        of the two KV caches that hold committed tokens; updated here."""
        k = self.draft_spec["k"]
        t_len, d_len = lens
        proposals, feed = [], committed[d_len:]
        for _ in range(k):
            logits = self.run(DRAFT, [slot], [d_len], [feed])
            d_len += len(feed)
            feed = [int(torch.argmax(logits[0]))]
            proposals.append(feed[0])
        pending = committed[t_len:]
        # One target pass scores every proposal: logits at the last committed token and after each proposal.
        preds = self.run(TARGET, [slot], [t_len], [pending + proposals],
                         logits_from=len(pending) - 1)[0].argmax(dim=-1).tolist()
        accepted = 0
        while accepted < k and preds[accepted] == proposals[accepted]:
            accepted += 1
        self.proposed += k
        self.accepted += accepted
        lens[0] = t_len + len(pending) + accepted
        lens[1] = len(committed) + min(accepted, k - 1)
        return proposals[:accepted] + [preds[accepted]]

    def decode(self, prompt: list[int], max_tokens: int, eos: int | None, sampling: SamplingParams = GREEDY,
               slot: int = 0) -> list[int]:
        """Rank 0: the tokens after ``prompt`` for one sequence alone in ``slot`` (the engine's own
        loop is engine.py's; this is the same passes for a single sequence)."""
        sampler, out = Sampler(sampling), []
        committed, lens = list(prompt), [0, 0]
        while len(out) < max_tokens:
            if self.draft is not None:
                new = self.speculate(slot, committed, lens)
            else:
                start = len(committed) - 1 if out else 0
                new = [sampler.pick(self.run(TARGET, [slot], [start], [committed[start:]])[0])]
            for tok in new:
                committed.append(tok)
                out.append(tok)
                if tok == eos or len(out) == max_tokens:
                    return out
        return out


def serve_requests(runner: RankRunner) -> int:
    """A non-driving rank: run every pass rank 0 announces, until it says stop."""
    try:
        runner.follow()
        log.info("Engine rank %d stopping", runner.rank)
        return 0
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
    no_dump.forbid()  # the mapped weights and the lease socket: see core/no_dump.py
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
