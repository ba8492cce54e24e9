"""A keyed hash of an arena's bytes, computed where the bytes are (on the GPU for a GPU arena).

Why not SHA-256: a GPU arena hashed with SHA-256 must first be copied to the host, 15 GiB through
PCIe and then through the CPU's hash threads, seconds per restart. What the daemon needs is weaker
than a public hash: it must notice if the bytes an engine hands back differ from the bytes it
packed, against an engine that never sees the key nor the digest. A keyed universal hash does that,
and it is a few multiply-adds per word that torch runs on the arena's own device.

The hash (two independent *lanes*, each a multilinear hash modulo the prime p = 2^61 - 1):

* level 1: the arena as signed 16-bit words, in blocks of L = 2^16 words (128 KiB); each block's
  value is sum(k_j * w_j) mod p with 31-bit keys k_j. Each product is below 2^46 in magnitude, so a
  whole block sums exactly in int64 before the reduction;
* level 2 and on: the block values (below 2^61), each split into four 16-bit words, hashed the same
  way with fresh keys, until one value is left (three levels for 15 GiB).

Keys come from SHAKE-256 of a 32-byte secret the daemon draws when it packs and keeps only in its
record (0600, in its 0700 state directory); the same keys on any device, so a CPU and a GPU compute
the same digest. For two different arenas of the same size, one level of one lane collides for at
most one key value in 2^31 (the differing word's key is the only free term, and a nonzero word
difference is invertible modulo p); with up to three levels that is below 2^-29 per lane, and
below 2^-58 for both lanes, for any forgery chosen without the key. An engine learns neither key
nor digest; all it sees is whether a restarted daemon adopted its offer, one try per restart.

Memory stays bounded: CHUNK_BLOCKS blocks (64 MiB of arena) are widened to int64 at a time.
"""

from __future__ import annotations

import hashlib
import os

import torch

P = (1 << 61) - 1
BLOCK_WORDS = 1 << 16  # |key * word| < 2^31 * 2^15 = 2^46; 2^16 of them sum below 2^62: exact in int64
CHUNK_BLOCKS = 512  # 64 MiB of arena per step: 256 MiB of int64 words, 256 MiB of products
LANES = 2
SECRET_BYTES = 32


def new_secret() -> str:
    return os.urandom(SECRET_BYTES).hex()


def _keys(secret: str, lane: int, level: int, n: int, device: torch.device) -> torch.Tensor:
    """n 31-bit keys for one lane and level, derived from the secret (the same on every device)."""
    raw = hashlib.shake_256(bytes.fromhex(secret) + bytes([lane, level])).digest(4 * n)
    keys = torch.frombuffer(bytearray(raw), dtype=torch.int32).to(torch.int64) & 0x7FFFFFFF
    return keys.to(device)


def _blocks(words: torch.Tensor) -> torch.Tensor:
    """A flat int64 tensor of words as rows of BLOCK_WORDS, zero-padded at the end."""
    pad = -words.numel() % BLOCK_WORDS
    if pad:
        words = torch.cat([words, words.new_zeros(pad)])
    return words.view(-1, BLOCK_WORDS)


def _level_one(flat: torch.Tensor, keys: list[torch.Tensor]) -> list[torch.Tensor]:
    """Per lane, the value of every 128 KiB block of a flat uint8 tensor (on its own device)."""
    words = flat.view(torch.int16) if flat.numel() % 2 == 0 else torch.cat([flat, flat.new_zeros(1)]).view(torch.int16)
    n_blocks = -(-words.numel() // BLOCK_WORDS)
    out = [torch.empty(n_blocks, dtype=torch.int64, device=flat.device) for _ in keys]
    step = CHUNK_BLOCKS * BLOCK_WORDS
    for b, start in enumerate(range(0, words.numel(), step)):
        wide = _blocks(words[start : start + step].to(torch.int64))
        rows = slice(b * CHUNK_BLOCKS, b * CHUNK_BLOCKS + wide.shape[0])
        for lane, k in enumerate(keys):
            torch.remainder((wide * k).sum(1), P, out=out[lane][rows])
        del wide
    return out


def _split(values: torch.Tensor) -> torch.Tensor:
    """Values below 2^61 as four 16-bit words each (little end first)."""
    return torch.stack([(values >> s) & 0xFFFF for s in (0, 16, 32, 48)], 1).reshape(-1)


def keyed_digest(arena: torch.Tensor, secret: str) -> list[int]:
    """The two lanes' hash values of a flat uint8 tensor, on the CPU or a GPU."""
    flat = arena.reshape(-1).view(torch.uint8)
    device = flat.device
    level1 = [_keys(secret, lane, 0, BLOCK_WORDS, device) for lane in range(LANES)]
    values = _level_one(flat, level1)
    digest = []
    for lane, v in enumerate(values):
        level = 1
        while v.numel() > 1:
            words = _blocks(_split(v))
            k = _keys(secret, lane, level, BLOCK_WORDS, device)
            v = torch.remainder((words * k).sum(1), P)
            level += 1
        digest.append(int(v.item()))
    if device.type == "cuda":  # the widened chunks stay in torch's pool otherwise: hundreds of MiB held for nothing
        del values, v
        torch.cuda.empty_cache()
    return digest
