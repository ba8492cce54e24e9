"""Parallel layouts: validating them, and which ranks each node and each process serves.

One formula places every rank, in the daemons and in the engine alike (upstream's):

    global rank = dp_rank * pp * tp + pp_rank * tp + tp_rank

so global ranks enumerate data-parallel, then pipeline, then tensor ranks. A node serves a
contiguous block of them: ``[node_rank * world / nnodes, (node_rank + 1) * world / nnodes)``, or,
with ``--data-parallel-size-local L --data-parallel-start-rank S``, the whole DP ranks
``S .. S+L-1``. A rank's *local rank* is its index in its node's block; it picks the GPU (on CPU it
is part of the device identity, so several CPU ranks share one machine, each with its own socket).

All daemons of a group (the target model, or the speculative draft) form one ``torch.distributed``
world on ``--weight-cache-master-port`` (gloo on CPU, nccl on CUDA), distinct from the engine's
``--master-port``. The engine forms one world per data-parallel rank on ``--master-port``.

Every user-facing error text of this module is a constant below; upstream's text where one exists.
"""

from __future__ import annotations

import logging
import socket
from dataclasses import dataclass

from wcache.core.config import Ranks
from wcache.core.device import cuda_device_count
from wcache.core.settings import ParallelSettings
from wcache.core.speculative import (
    CACHED_DRAFT_METHODS,
    SpecConfig,
    parse_speculative_config,
)
from wcache.errors import ParallelConfigError
from wcache.model import quant

log = logging.getLogger("wcache.ranks")

DEFAULT_MASTER_ADDR = "127.0.0.1"
DEFAULT_MASTER_PORT = 29501  # the engine's default rendezvous port (upstream's)

# -- error texts ------------------------------------------------------------------------------
AT_LEAST_ONE = "{flag} must be at least 1, got {value}"
NODE_RANK_RANGE = "--node-rank must be between 0 and {last} for --nnodes {nnodes}, got {value}"
HEADS_NOT_DIVISIBLE = ("Total number of attention heads ({heads}) must be divisible by tensor parallel "
                       "size ({tp}).")
KV_HEADS_NOT_DIVISIBLE = ("Total number of key-value heads ({kv}) must be divisible by tensor parallel "
                          "size ({tp}).")
PP_TOO_LARGE = "Pipeline parallel size ({pp}) exceeds the number of hidden layers ({layers})."
WORLD_NOT_DIVISIBLE = ("The world of {world} ranks (data x pipeline x tensor parallel) cannot be split "
                       "evenly over --nnodes {nnodes}")
DP_FLAGS_WITHOUT_DP = ("--data-parallel-size-local and --data-parallel-start-rank need "
                       "--data-parallel-size > 1")
DP_RANGE = ("--data-parallel-start-rank + --data-parallel-size-local ({end}) exceeds "
            "--data-parallel-size ({dp})")
MASTER_PORT_REQUIRED = "--weight-cache-master-port is required when the daemons span nodes"
MASTER_PORT_CLASH = ("--weight-cache-master-port ({port}) must differ from the engine's --master-port: "
                     "the daemons hold their group open while the engine forms its own")
DRAFT_PORT_CLASH = "--weight-cache-draft-master-port must differ from --weight-cache-master-port"
TOO_FEW_GPUS = "This node serves {n} local rank(s) but torch sees {m} CUDA device(s)"
DP_RANK_REQUIRED = ("wcache serve runs one engine per data-parallel rank: pass --data-parallel-rank "
                    "(0 to {last}) and give each engine its own --port")
DP_RANK_RANGE = "--data-parallel-rank must be between 0 and {last}, got {value}"
DP_RANK_NOT_LOCAL = ("Data-parallel rank {rank} has no ranks on node {node}; this node serves "
                     "global ranks {lo} to {hi}")
SPEC_PP = "Speculative decoding is not supported with --pipeline-parallel-size > 1"
SPEC_VOCAB = "The draft model's vocabulary ({draft}) differs from the target model's ({target})"
SPEC_SOCKET_PATH = ("socket_path cannot be combined with a cached speculative draft ({methods}), which "
                    "needs separate target and draft sockets; use socket_dir")


def check_draft(spec: SpecConfig, target_hf: dict, tp: int, pp: int) -> dict:
    """The draft's config.json, after checking that it fits the target's layout."""
    from wcache.core.checkpoint_files import read_config

    if pp > 1:
        raise ParallelConfigError(SPEC_PP)
    hf = read_config(spec.model)
    if hf["vocab_size"] != target_hf["vocab_size"]:
        raise ParallelConfigError(SPEC_VOCAB.format(draft=hf["vocab_size"], target=target_hf["vocab_size"]))
    check_model_fits(hf, tp, 1)
    return hf


# -- the layout -------------------------------------------------------------------------------
def split_global_rank(g: int, tp: int, pp: int) -> tuple[int, int, int]:
    """(dp_rank, pp_rank, tp_rank) of a global rank."""
    return g // (tp * pp), (g // tp) % pp, g % tp


@dataclass(frozen=True)
class RankLayout:
    tp: int
    pp: int
    dp: int
    nnodes: int
    node_rank: int
    first: int  # this node's first global rank
    count: int  # how many consecutive global ranks this node serves
    master_addr: str
    master_port: int

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def spans_nodes(self) -> bool:
        return self.count < self.world_size

    def ranks_of(self, g: int) -> Ranks:
        dp_rank, pp_rank, tp_rank = split_global_rank(g, self.tp, self.pp)
        return Ranks(tp_size=self.tp, pp_size=self.pp, dp_size=self.dp, tp_rank=tp_rank, pp_rank=pp_rank,
                     dp_rank=dp_rank, local_rank=g - self.first)

    def local_ranks(self) -> list[Ranks]:
        return [self.ranks_of(g) for g in range(self.first, self.first + self.count)]

    def describe(self) -> str:
        return (f"node {self.node_rank}/{self.nnodes} serves global rank(s) {self.first} to "
                f"{self.first + self.count - 1} of {self.world_size} (tp={self.tp}, pp={self.pp}, dp={self.dp})")


def check_model_fits(hf: dict, tp: int, pp: int) -> None:
    heads = hf["num_attention_heads"]
    kv = hf.get("num_key_value_heads", heads)
    if heads % tp:
        raise ParallelConfigError(HEADS_NOT_DIVISIBLE.format(heads=heads, tp=tp))
    if kv % tp:
        raise ParallelConfigError(KV_HEADS_NOT_DIVISIBLE.format(kv=kv, tp=tp))
    if pp > hf["num_hidden_layers"]:
        raise ParallelConfigError(PP_TOO_LARGE.format(pp=pp, layers=hf["num_hidden_layers"]))
    # An FP8 checkpoint's slices must hold whole scale blocks (quant.Fp8BlockCheckpoint).
    quant.resolve(None, hf).check_layout(hf, tp)


def plan_layout(p: ParallelSettings, hf: dict, device: str = "cpu") -> RankLayout:
    """Validate the parallel flags against each other and the model; this node's block of ranks."""
    tp, pp, dp = p.tensor_parallel_size, p.pipeline_parallel_size, p.data_parallel_size
    for flag, value in (("--tensor-parallel-size", tp), ("--pipeline-parallel-size", pp),
                        ("--data-parallel-size", dp), ("--nnodes", p.nnodes)):
        if value < 1:
            raise ParallelConfigError(AT_LEAST_ONE.format(flag=flag, value=value))
    nnodes, node_rank = p.nnodes, p.node_rank
    if not 0 <= node_rank < nnodes:
        raise ParallelConfigError(NODE_RANK_RANGE.format(last=nnodes - 1, nnodes=nnodes, value=node_rank))
    check_model_fits(hf, tp, pp)
    world = tp * pp * dp
    dp_local, dp_start = p.data_parallel_size_local, p.data_parallel_start_rank
    if dp == 1 and (dp_local not in (None, 1) or dp_start not in (None, 0)):
        raise ParallelConfigError(DP_FLAGS_WITHOUT_DP)
    if dp > 1 and (dp_local is not None or dp_start is not None):
        if dp_local is None:
            if dp % nnodes:
                raise ParallelConfigError(WORLD_NOT_DIVISIBLE.format(world=world, nnodes=nnodes))
            dp_local = dp // nnodes
        if dp_local < 1:
            raise ParallelConfigError(AT_LEAST_ONE.format(flag="--data-parallel-size-local", value=dp_local))
        if dp_start is None:
            dp_start = node_rank * dp_local
        if dp_start < 0 or dp_start + dp_local > dp:
            raise ParallelConfigError(DP_RANGE.format(end=dp_start + dp_local, dp=dp))
        first, count = dp_start * tp * pp, dp_local * tp * pp
    else:
        if world % nnodes:
            raise ParallelConfigError(WORLD_NOT_DIVISIBLE.format(world=world, nnodes=nnodes))
        count = world // nnodes
        first = node_rank * count
    if device == "cuda":
        if count > (visible := cuda_device_count()):
            raise ParallelConfigError(TOO_FEW_GPUS.format(n=count, m=visible))
    addr = (p.data_parallel_address if dp > 1 else None) or p.master_addr
    return RankLayout(tp, pp, dp, nnodes, node_rank, first, count, addr, p.master_port)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


# -- the daemons' worlds ----------------------------------------------------------------------
@dataclass(frozen=True)
class DaemonPlan:
    layout: RankLayout
    groups: list[dict]  # per daemon group: spec overrides (model, draft, world)

    def describe(self) -> str:
        roles = " + ".join("draft" if g.get("draft") else "target" for g in self.groups)
        return f"{self.layout.describe()}; roles: {roles}"


def plan_daemons(p: ParallelSettings, cfg) -> DaemonPlan:
    """Validate the flags of ``wcache preload``; one entry per daemon group (target, maybe draft)."""
    layout = plan_layout(p, cfg.hf, cfg.device)
    port = p.weight_cache_master_port
    if layout.spans_nodes and port is None:
        raise ParallelConfigError(MASTER_PORT_REQUIRED)
    if port is not None and port == p.master_port:
        raise ParallelConfigError(MASTER_PORT_CLASH.format(port=port))
    if port is None:
        port = free_port()
    backend = "nccl" if cfg.device == "cuda" else "gloo"

    def world(p: int) -> dict:
        return {"init_method": f"tcp://{layout.master_addr}:{p}", "world_size": layout.world_size,
                "backend": backend}

    groups = [{"draft": False, "world": world(port)}]
    spec = parse_speculative_config(p.speculative_config)
    if spec is not None:
        check_draft(spec, cfg.hf, layout.tp, layout.pp)
        if spec.cached:
            draft_port = p.weight_cache_draft_master_port
            if draft_port is None:
                draft_port = port + 1 if layout.spans_nodes else free_port()
            if draft_port == port:
                raise ParallelConfigError(DRAFT_PORT_CLASH)
            groups.append({"draft": True, "model": str(spec.model), "quantization": None, "world": world(draft_port)})
        else:
            log.info("The %s draft is not cached (upstream caches only %s drafts); engines load it from disk",
                     spec.method, ", ".join(CACHED_DRAFT_METHODS))
    return DaemonPlan(layout, groups)


# -- the engine's ranks -----------------------------------------------------------------------
@dataclass(frozen=True)
class EnginePlan:
    layout: RankLayout
    dp_rank: int
    local: list[Ranks]  # this node's ranks of the engine, the first one run by the serve process

    @property
    def world_size(self) -> int:
        return self.layout.tp * self.layout.pp

    def engine_rank(self, r: Ranks) -> int:
        return r.pp_rank * r.tp_size + r.tp_rank

    @property
    def drives(self) -> bool:
        """Whether this node holds engine rank 0, which serves HTTP and drives the others."""
        return self.engine_rank(self.local[0]) == 0

    @property
    def init_method(self) -> str:
        return f"tcp://{self.layout.master_addr}:{self.layout.master_port}"


def plan_engine(p: ParallelSettings, hf: dict, device: str) -> EnginePlan:
    layout = plan_layout(p, hf, device)
    dp_rank = p.data_parallel_rank
    if layout.dp > 1 and dp_rank is None:
        raise ParallelConfigError(DP_RANK_REQUIRED.format(last=layout.dp - 1))
    dp_rank = dp_rank or 0
    if not 0 <= dp_rank < layout.dp:
        raise ParallelConfigError(DP_RANK_RANGE.format(last=layout.dp - 1, value=dp_rank))
    local = [r for r in layout.local_ranks() if r.dp_rank == dp_rank]
    if not local:
        raise ParallelConfigError(DP_RANK_NOT_LOCAL.format(rank=dp_rank, node=layout.node_rank, lo=layout.first,
                                                           hi=layout.first + layout.count - 1))
    return EnginePlan(layout, dp_rank, local)


