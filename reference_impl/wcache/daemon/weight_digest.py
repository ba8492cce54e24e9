"""Per-chunk digests of an arena's bytes for weight seeding: the source computes them from its arena
once, sends them before the bytes, and the replica checks the bytes it received against them before
it packs or serves anything.

* CPU arenas: XXH3-128 per chunk (about 6 GB/s on one core here, where SHA-256 does 0.8: the
  hash must not cost more than the network), SHA-256 where the xxhash package is missing. Chunks
  hash on threads while later chunks arrive.
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


class Checker:
    """Checks a buffer's chunks against the source's digests while the rest still arrives: CPU
    chunks are hashed on a thread as soon as they are complete (``received``), so only the last
    chunk's hash is left when the last byte comes. Keyed (GPU) digests are all checked at the end,
    on the device."""

    def __init__(self, data: torch.Tensor, header: dict, device: torch.device | None = None):
        self.data, self.header, self.device = data, header, device
        self.bounds = chunk_bounds(data.numel(), header["chunk_bytes"])
        self.early = header["algorithm"] in CPU_ALGORITHMS
        self.pool = ThreadPoolExecutor(HASH_THREADS) if self.early else None
        self.futures: list = []

    def received(self, upto: int) -> None:
        """Bytes [0, upto) are in: hash every chunk they complete."""
        while self.early and len(self.futures) < len(self.bounds) and self.bounds[len(self.futures)][1] <= upto:
            a, b = self.bounds[len(self.futures)]
            self.futures.append(self.pool.submit(_one, self.data[a:b], self.header["algorithm"], None))

    def bad(self) -> list[int]:
        if not self.early:
            return bad_chunks(self.data, self.header, self.device)
        self.received(self.data.numel())
        got = [f.result() for f in self.futures]
        self.pool.shutdown()
        return [i for i, (g, w) in enumerate(zip(got, self.header["chunks"])) if g != w]

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(cancel_futures=True)
        self.data = self.futures = None  # no view of the buffer left: a memfd's mapping can then close


def bad_chunks(data: torch.Tensor, header: dict, device: torch.device | None = None) -> list[int]:
    """Indices of the chunks whose bytes do not match the digests the source sent."""
    got = digests(data, header["algorithm"], header.get("secret"), header["chunk_bytes"], device)
    want = header["chunks"]
    return [i for i, (g, w) in enumerate(zip(got, want)) if g != w] + list(range(len(want), len(got)))
