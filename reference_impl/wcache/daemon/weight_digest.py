"""Per-chunk digests of an arena's bytes for weight seeding: the source computes them from its arena
once, sends them before the bytes, and the replica checks the bytes it received against them before
it packs or serves anything.

* CPU arenas: SHA-256 per chunk; hashlib releases the GIL, so chunks hash on threads.
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

CHUNK_BYTES = 64 << 20
HASH_THREADS = 2


def algorithm_for(device_type: str) -> str:
    return "sha256" if device_type == "cpu" else "keyed61"


def chunk_bounds(size: int, chunk: int = CHUNK_BYTES) -> list[tuple[int, int]]:
    return [(start, min(size, start + chunk)) for start in range(0, size, chunk)]


def _one(data: torch.Tensor, algorithm: str, secret: str | None) -> str:
    if algorithm == "sha256":
        return hashlib.sha256(memoryview(data.numpy())).hexdigest()
    return "-".join(str(v) for v in arena_hash.keyed_digest(data, secret))


def digests(data: torch.Tensor, algorithm: str, secret: str | None = None, chunk: int = CHUNK_BYTES,
            device: torch.device | None = None) -> list[str]:
    """The digest of every chunk of a flat uint8 tensor (on the CPU or a GPU). ``device``: hash each
    chunk there (a replica's host-staged bytes are checked on its GPU, a chunk at a time)."""
    parts = [data[a:b] for a, b in chunk_bounds(data.numel(), chunk)]
    if algorithm == "sha256":
        with ThreadPoolExecutor(HASH_THREADS) as pool:
            return list(pool.map(lambda p: _one(p, algorithm, secret), parts))
    return [_one(p.to(device) if device is not None else p, algorithm, secret) for p in parts]


def new_secret(algorithm: str) -> str | None:
    return arena_hash.new_secret() if algorithm == "keyed61" else None


def bad_chunks(data: torch.Tensor, header: dict, device: torch.device | None = None) -> list[int]:
    """Indices of the chunks whose bytes do not match the digests the source sent."""
    got = digests(data, header["algorithm"], header.get("secret"), header["chunk_bytes"], device)
    want = header["chunks"]
    return [i for i, (g, w) in enumerate(zip(got, want)) if g != w] + list(range(len(want), len(got)))
