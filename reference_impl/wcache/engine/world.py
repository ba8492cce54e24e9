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

    # -- the request channel: rank 0 broadcasts a 7-int64 header, then the prompt's ids ----------
    # header: op, prompt length, max_tokens, the sampling settings (3 ints, sampling.py), and whether
    # rank 0 will say after every token if the sequence stops (stop strings, a client gone).
    def send_request(self, op: int, prompt, max_tokens: int, with_prompt: bool, sampling: list[int] = (0, 0, -1),
                     stops: bool = False) -> None:
        if self.size == 1:
            return
        import torch.distributed as dist

        dev = self._device()
        header = [op, len(prompt), max_tokens, *sampling, int(stops)]
        dist.broadcast(torch.tensor(header, dtype=torch.long, device=dev), 0)
        if with_prompt:
            dist.broadcast(torch.tensor(list(prompt), dtype=torch.long, device=dev), 0)

    def recv_request(self, has_prompt) -> tuple[int, list[int], int, list[int], bool]:
        import torch.distributed as dist

        dev = self._device()
        header = torch.empty(7, dtype=torch.long, device=dev)
        dist.broadcast(header, 0)
        op, n, max_tokens, *sampling, stops = header.tolist()
        prompt: list[int] = []
        if has_prompt(op):
            ids = torch.empty(n, dtype=torch.long, device=dev)
            dist.broadcast(ids, 0)
            prompt = ids.tolist()
        return op, prompt, max_tokens, sampling, bool(stops)

    def share_flag(self, flag: bool) -> bool:
        """Rank 0's ``flag`` on every rank (whether to stop the sequence now)."""
        if self.size == 1:
            return flag
        import torch.distributed as dist

        t = torch.tensor([int(flag)], dtype=torch.long, device=self._device())
        dist.broadcast(t, 0)
        return bool(t.item())

    # -- pipeline hand-offs and the last stage's logits ----------------------------------------
    def recv_hidden(self, shape, dtype, device) -> torch.Tensor:
        import torch.distributed as dist

        x = torch.empty(*shape, dtype=dtype, device=device)
        dist.recv(x, src=self.rank - self.tp)
        return x

    def send_hidden(self, out: torch.Tensor) -> None:
        import torch.distributed as dist

        dist.send(out.contiguous(), dst=self.rank + self.tp)

    def broadcast_logits(self, logits: torch.Tensor) -> None:
        if self.size > 1:
            import torch.distributed as dist

            dist.broadcast(logits, src=(self.pp - 1) * self.tp)
