"""Joining a torch.distributed world, and leaving a process that joined one.

The daemons of a group form one world (``join_daemon_world``); the engine's ranks form their own
(engine/worker/world.py). Both leave through ``exit_after_collectives``.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from datetime import timedelta

from wcache.core.config import Ranks
from wcache.errors import ParallelConfigError

log = logging.getLogger("wcache.ranks")

RENDEZVOUS_TIMEOUT = timedelta(minutes=30)  # torch's default: how long a rank waits for the others
DIGEST_MISMATCH = ("Checkpoint content differs across weight cache daemon ranks ({detail}); every node "
                   "must serve the same checkpoint")


def join_daemon_world(world: dict | None, ranks: Ranks, device: str, digest: str) -> None:
    """Join the daemons' torch.distributed world and check that every rank hashed the same checkpoint.

    Called by each daemon rank before it loads, as upstream does, so collectives work during
    post-processing. SIGTERM/SIGINT terminate at once while waiting here: nothing is bound yet,
    and a rank blocked in the rendezvous would not run a Python handler.
    """
    if not world or world.get("world_size", 1) <= 1:
        return
    import torch
    import torch.distributed as dist

    rank = ranks.global_rank
    old = {s: signal.signal(s, signal.SIG_DFL) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        tensor_device = torch.device("cpu")
        if world["backend"] == "nccl":
            torch.cuda.set_device(ranks.local_rank)
            tensor_device = torch.device("cuda", ranks.local_rank)
        dist.init_process_group(world["backend"], init_method=world["init_method"], rank=rank,
                                world_size=world["world_size"], timeout=RENDEZVOUS_TIMEOUT)
        mine = torch.tensor(list(bytes.fromhex(digest)), dtype=torch.uint8, device=tensor_device)
        gathered = [torch.empty_like(mine) for _ in range(world["world_size"])]
        dist.all_gather(gathered, mine)
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    digests = [bytes(t.cpu().tolist()).hex() for t in gathered]
    if len(set(digests)) > 1:
        groups: dict[str, list[int]] = {}
        for r, d in enumerate(digests):
            groups.setdefault(d[:12], []).append(r)
        detail = "; ".join(f"rank(s) {rs} have {d}" for d, rs in groups.items())
        raise ParallelConfigError(DIGEST_MISMATCH.format(detail=detail))
    log.info("Rank %d joined the daemon world of %d at %s (%s); all ranks hold checkpoint %s", rank,
             world["world_size"], world["init_method"], world["backend"], digest[:12])


def exit_after_collectives(code: int) -> None:
    """Leave the process without running the process group's C++ teardown.

    Callers have stopped their work (ranks told to stop, leases closed, or startup failed with a
    logged reason). What is left is gloo's destructor, which aborts the process ("terminate called
    without an active exception", SIGABRT, exit -6) when a peer on another node has already closed
    its connections: a clean stop, or a clear exit 2, must not look like a crash to Docker or
    Kubernetes.
    """
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
