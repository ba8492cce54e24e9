"""The engine's torch.distributed world: joining it, and every collective the engine ranks run.

One world per engine (per data-parallel rank), on ``--master-addr``/``--master-port``; gloo on CPU,
nccl on CUDA. A world of one rank joins nothing and every collective is a no-op, so the same
RankRunner code serves the plain engine.
"""

from __future__ import annotations

import logging
from datetime import timedelta

import torch

from wcache.core.config import Ranks
from wcache.errors import EngineWorldError

log = logging.getLogger("wcache.engine")

# Idle ranks wait in a broadcast for the next request; rank 0 sends a keepalive well within the
# collective timeout so an idle engine never times out, while a dead peer is still noticed.
DIST_TIMEOUT = timedelta(minutes=30)
LOST_PEERS = "Engine rank {rank} lost contact with the other ranks: {error}"


class World:
    def __init__(self, ranks: Ranks, backend: str = "gloo", init_method: str | None = None):
        self.ranks, self.backend, self.init_method = ranks, backend, init_method
        self.tp, self.pp = ranks.tp_size, ranks.pp_size
        self.size = self.tp * self.pp
        self.rank = ranks.pp_rank * self.tp + ranks.tp_rank
        self.tp_group = None

    def join(self) -> None:
        if self.size == 1:
            return
        import torch.distributed as dist

        if self.backend == "nccl":
            torch.cuda.set_device(self.ranks.local_rank)
        try:
            dist.init_process_group(self.backend, init_method=self.init_method, rank=self.rank, world_size=self.size,
                                    timeout=DIST_TIMEOUT)
        except dist.DistNetworkError as e:  # rank 0 cannot listen there (the port is taken), or no rank 0 answers
            raise EngineWorldError(self.rank, self.init_method, str(e).splitlines()[0]) from None
        if self.pp > 1 and self.tp > 1:  # one tensor-parallel group per stage; every rank makes all of them
            for stage in range(self.pp):
                group = dist.new_group([stage * self.tp + t for t in range(self.tp)])
                if stage == self.ranks.pp_rank:
                    self.tp_group = group
        log.info("Engine rank %d of %d joined the world at %s", self.rank, self.size, self.init_method)

    def _device(self) -> torch.device:
        return torch.device("cuda", self.ranks.local_rank) if self.backend == "nccl" else torch.device("cpu")

    def barrier(self) -> None:
        if self.size > 1:
            import torch.distributed as dist

            dist.barrier()

    def least(self, value: int) -> int:
        """The smallest ``value`` over every rank (int64)."""
        if self.size == 1:
            return value
        import torch.distributed as dist

        t = torch.tensor([value], dtype=torch.long, device=self._device())
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t.item())

    def all_reduce_tp(self, t: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        dist.all_reduce(t, group=self.tp_group)
        return t

    # -- the step channel: before every forward pass rank 0 broadcasts one int64 header -------
    # Its length is fixed when the engine starts (runner.py sizes it for the longest step), so every
    # rank receives it with one collective and no length exchange; runner.py says what it holds.
    def send_step(self, header: list[int], length: int) -> None:
        if self.size == 1:
            return
        import torch.distributed as dist

        t = torch.zeros(length, dtype=torch.long)
        t[: len(header)] = torch.tensor(header, dtype=torch.long)
        dist.broadcast(t.to(self._device()), 0)

    def recv_step(self, length: int) -> list[int]:
        import torch.distributed as dist

        t = torch.empty(length, dtype=torch.long, device=self._device())
        dist.broadcast(t, 0)
        return t.tolist()

    # -- pipeline hand-offs and the last stage's logits ----------------------------------------
    def recv_hidden(self, shape, dtype, device) -> torch.Tensor:
        import torch.distributed as dist

        x = torch.empty(*shape, dtype=dtype, device=device)
        dist.recv(x, src=self.rank - self.tp)
        return x

    def send_hidden(self, out: torch.Tensor) -> None:
        import torch.distributed as dist

        dist.send(out.contiguous(), dst=self.rank + self.tp)

    @property
    def logits_rank(self) -> int:
        """The rank that sends the logits to rank 0: the last stage's first rank."""
        return (self.pp - 1) * self.tp

    def send_logits(self, logits: torch.Tensor) -> None:
        import torch.distributed as dist

        dist.send(logits.contiguous(), dst=0)

    def recv_logits(self, shape, device) -> torch.Tensor:
        import torch.distributed as dist

        logits = torch.empty(*shape, dtype=torch.float32, device=device)
        dist.recv(logits, src=self.logits_rank)
        return logits
