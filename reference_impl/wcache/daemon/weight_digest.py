"""Per-chunk digests of an arena's bytes for weight seeding: the source computes them from its arena
once, sends them before the bytes, and the replica checks the bytes it received against them before
it packs or serves anything.

* CPU arenas: XXH3-128 per chunk (about 6 GB/s on one core here, where SHA-256 does 0.8: the
  hash must not cost more than the network), SHA-256 where the xxhash package is missing. The
  replica hashes each piece as it lands (Checker.feed), while the piece is still in the cache.
* CUDA arenas: the keyed multilinear hash of daemon/arena_hash.py per chunk, computed on the GPU
  where the bytes are (SHA-256 would first copy the whole arena to the host). The source draws the
  key and sends it with the digests. That is enough here: the digests catch bytes changed in transit
  and a source that sends other bytes than its arena's (a bug, a truncated or shifted stream), not a
  source that means harm; one that holds the token could send any arena with matching digests.
"""

from __future__ import annotations

import hashlib
from concurrent.futures import ThreadPoolExecutor

import torch

from wcache.daemon import arena_hash

try:
    import xxhash
except ImportError:  # a host without it hashes with SHA-256 (what a replica accepts: CPU_ALGORITHMS)
    xxhash = None

CHUNK_BYTES = 64 << 20
HASH_THREADS = 2


CPU_ALGORITHMS = ("xxh3_128", "sha256") if xxhash is not None else ("sha256",)


def algorithm_for(device_type: str) -> str:
    return CPU_ALGORITHMS[0] if device_type == "cpu" else "keyed61"


def accepted(device_type: str) -> tuple[str, ...]:
    """The algorithms a replica on this device type can check."""
    return CPU_ALGORITHMS if device_type == "cpu" else ("keyed61",)


def chunk_bounds(size: int, chunk: int = CHUNK_BYTES) -> list[tuple[int, int]]:
    return [(start, min(size, start + chunk)) for start in range(0, size, chunk)]


def _one(data: torch.Tensor, algorithm: str, secret: str | None) -> str:
    if algorithm == "xxh3_128":
        return xxhash.xxh3_128(memoryview(data.numpy())).hexdigest()
    if algorithm == "sha256":
        return hashlib.sha256(memoryview(data.numpy())).hexdigest()
    return "-".join(str(v) for v in arena_hash.keyed_digest(data, secret))


def digests(data: torch.Tensor, algorithm: str, secret: str | None = None, chunk: int = CHUNK_BYTES,
            device: torch.device | None = None) -> list[str]:
    """The digest of every chunk of a flat uint8 tensor (on the CPU or a GPU). ``device``: hash each
    chunk there (a replica's host-staged bytes are checked on its GPU, a chunk at a time)."""
    parts = [data[a:b] for a, b in chunk_bounds(data.numel(), chunk)]
    if algorithm in CPU_ALGORITHMS:
        with ThreadPoolExecutor(HASH_THREADS) as pool:
            return list(pool.map(lambda p: _one(p, algorithm, secret), parts))
    return [_one(p.to(device) if device is not None else p, algorithm, secret) for p in parts]


def new_secret(algorithm: str) -> str | None:
    return arena_hash.new_secret() if algorithm == "keyed61" else None


def _hasher(algorithm: str):
    return xxhash.xxh3_128() if algorithm == "xxh3_128" else hashlib.sha256()


class Checker:
    """Checks the bytes a replica receives against the source's digests. CPU digests are computed as
    the bytes pass (``feed``, in order, on the receiving thread): each piece is hashed just after the
    socket's copy wrote it, while it is still in the cache, so checking costs no pass of its own over
    the arena and only a hash of a piece separates the last byte from the verdict. Keyed (GPU)
    digests are all checked at the end, on the device, over ``data``."""

    def __init__(self, data: torch.Tensor | None, header: dict, size: int, device: torch.device | None = None):
        self.data, self.header, self.device = data, header, device
        self.bounds = chunk_bounds(size, header["chunk_bytes"])
        self.streaming = header["algorithm"] in CPU_ALGORITHMS
        self.pos, self.got = 0, []
        self.hasher = _hasher(header["algorithm"]) if self.streaming else None

    def feed(self, view: memoryview) -> None:
        """The next bytes of the arena, in order."""
        if not self.streaming:
            return
        while len(view) and len(self.got) < len(self.bounds):
            end = self.bounds[len(self.got)][1]
            take = min(len(view), end - self.pos)
            self.hasher.update(view[:take])
            self.pos += take
            view = view[take:]
            if self.pos == end:
                self.got.append(self.hasher.hexdigest())
                self.hasher = _hasher(self.header["algorithm"])
        if len(view):  # more than the chunks cover: the stream's own check (oversent) names it
            self.pos += len(view)

    def bad(self) -> list[int]:
        if not self.streaming:
            return bad_chunks(self.data, self.header, self.device)
        want = self.header["chunks"]
        # a chunk never completed (a short stream) is bad as well
        return [i for i, w in enumerate(want) if i >= len(self.got) or self.got[i] != w]

    def close(self) -> None:
        self.data = self.hasher = None  # no view of the buffer left: a mapping can then close


def bad_chunks(data: torch.Tensor, header: dict, device: torch.device | None = None) -> list[int]:
    """Indices of the chunks whose bytes do not match the digests the source sent."""
    got = digests(data, header["algorithm"], header.get("secret"), header["chunk_bytes"], device)
    want = header["chunks"]
    return [i for i, (g, w) in enumerate(zip(got, want)) if g != w] + list(range(len(want), len(got)))
