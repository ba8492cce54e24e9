"""A seeding round's fan-out: one source, N replicas, and each byte leaves the source about once.

The round uses torch.distributed's own collectives over gloo (TCP), in process groups made for the
round alone (``ProcessGroupGloo`` over a ``TCPStore`` the source opens on an ephemeral port), never
the default group, which a daemon of a multi-node world already holds.

Why not ``broadcast``: gloo's broadcast is a binomial tree whose root sends the whole buffer to each
of its ceil(log2(N+1)) children; measured here with 5 ranks and 64 MiB, the root sent 192 MiB. So a
round is a broadcast made of two collectives (van de Geijn's): the source *scatters* each chunk in
N equal pieces, one per replica, which sends the chunk once; then the replicas *all-gather* the
pieces among themselves, in a second group the source is not part of (gloo's ring all-gather: each
replica sends (N-1)/N of the chunk). The next chunk's scatter is posted before this chunk's
all-gather is waited for, so the two overlap.

Every collective has ``ROUND_TIMEOUT``: a replica that stalls or dies fails the round for all of it,
each replica then falls back (weight_pull.py), and the source goes on serving.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from wcache.daemon.weight_digest import chunk_bounds

ROUND_TIMEOUT = timedelta(seconds=60)
# A round moves the arena in chunks of its own (the source says which in the round's header): gloo's
# all-gather gathers into a flat buffer it allocates per call and then copies out; at 16 MiB that
# buffer comes back from the allocator's heap, already touched and mostly in the cache, where a
# 64 MiB one is a fresh mapping whose every page faults.
ROUND_CHUNK_BYTES = 16 << 20


def bytes_written() -> int:
    """Bytes this process has passed to write-family calls (sockets included): /proc/self/io's wchar,
    all threads together; what the record calls the bytes a daemon sent."""
    try:
        with open("/proc/self/io") as f:
            for line in f:
                if line.startswith("wchar:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def _options(host: str) -> dist.ProcessGroupGloo._Options:
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = ROUND_TIMEOUT
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
    return opts


def _group(store, prefix: str, rank: int, size: int, host: str):
    return dist.ProcessGroupGloo(dist.PrefixStore(prefix, store), rank, size, _options(host))


def open_store(host: str) -> dist.TCPStore:
    """The round's rendezvous, on an ephemeral port of the source's seeding address."""
    return dist.TCPStore(host, 0, None, True, ROUND_TIMEOUT, wait_for_workers=False)


def _scatter_opts() -> dist.ScatterOptions:
    o = dist.ScatterOptions()
    o.rootRank = 0
    return o


def _pieces(a: int, b: int, n: int) -> int:
    return -(-(b - a) // n)


def send(store, prefix: str, world: int, host: str, arena: torch.Tensor, chunk: int = ROUND_CHUNK_BYTES) -> None:
    """The source's side: scatter every chunk of ``arena`` (flat uint8, CPU or CUDA) to the replicas."""
    pg = _group(store, prefix, 0, world, host)
    n = world - 1
    pending = None
    for a, b in chunk_bounds(arena.numel(), chunk):
        piece = _pieces(a, b, n)
        data = arena[a:b].cpu()  # a CUDA arena: staged through the host, a chunk at a time
        if piece * n != b - a:
            padded = torch.zeros(piece * n, dtype=torch.uint8)
            padded[: b - a] = data
            data = padded
        parts = list(data.split(piece))
        work = pg.scatter([torch.empty(piece, dtype=torch.uint8)], [[parts[0], *parts]], _scatter_opts())
        if pending is not None:
            pending.wait()
        pending = work
    if pending is not None:
        pending.wait()


def receive(store_host: str, port: int, prefix: str, rank: int, world: int, host: str, size: int, target,
            checker, chunk: int = ROUND_CHUNK_BYTES) -> None:
    """A replica's side: its piece of every chunk from the source, then the others' from the ring,
    into ``target`` (seed_target.py) a chunk at a time, each chunk hashed (``checker``) as it lands."""
    store = dist.TCPStore(store_host, port, None, False, ROUND_TIMEOUT)
    pg = _group(store, prefix, rank, world, host)
    ring = _group(store, prefix + "/ring", rank - 1, world - 1, host)
    n = world - 1
    bounds = chunk_bounds(size, chunk)
    # Two piece buffers, reused: the next chunk's scatter lands in one while the ring reads the other.
    spare = [torch.empty(_pieces(0, chunk, n), dtype=torch.uint8) for _ in range(2 if len(bounds) > 1 else 1)]

    def post(i: int):
        a, b = bounds[i]
        mine = spare[i % len(spare)][: _pieces(a, b, n)]
        return mine, pg.scatter([mine], [], _scatter_opts())

    nxt = post(0) if bounds else None
    for i, (a, b) in enumerate(bounds):
        mine, work = nxt
        work.wait()
        if i + 1 < len(bounds):
            nxt = post(i + 1)
        piece = mine.numel()
        out = torch.frombuffer(target.into(a, piece * n), dtype=torch.uint8) if piece * n == b - a \
            else torch.empty(piece * n, dtype=torch.uint8)  # the last chunk, padded to n pieces
        ring.allgather([list(out.split(piece))], [mine]).wait()
        view = memoryview(out.numpy())[: b - a]
        if piece * n != b - a:
            view = _copied(target.into(a, b - a), view)
        checker.feed(view)
        target.landed(a, view)


def _copied(dest: memoryview, src: memoryview) -> memoryview:
    dest[:] = src
    return dest
