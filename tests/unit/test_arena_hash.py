"""daemon/arena_hash.py: the keyed hash a restarted daemon checks an adopted arena with, on the CPU
(tests/gpu/test_arena_hash_gpu.py runs the same code on a GPU and compares)."""

from __future__ import annotations

import torch
from wcache.daemon.arena_hash import BLOCK_WORDS, keyed_digest, new_secret


def arena(nbytes: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def test_equal_bytes_equal_digest_and_any_change_is_seen():
    secret, t = new_secret(), arena(3 * 2 * BLOCK_WORDS + 4096)  # three blocks and a part of one
    d = keyed_digest(t, secret)
    assert len(d) == 2 and keyed_digest(t.clone(), secret) == d
    for where in (0, 1, 2 * BLOCK_WORDS + 7, t.numel() - 1):
        u = t.clone()
        u[where] ^= 0x80
        assert keyed_digest(u, secret) != d, where


def test_swapped_blocks_and_another_key_give_another_digest():
    secret, t = new_secret(), arena(4 * 2 * BLOCK_WORDS, seed=1)
    block = 2 * BLOCK_WORDS
    swapped = torch.cat([t[block : 2 * block], t[:block], t[2 * block :]])
    assert keyed_digest(swapped, secret) != keyed_digest(t, secret)  # level 2 is positional
    assert keyed_digest(t, new_secret()) != keyed_digest(t, secret)


def test_views_of_any_dtype_hash_their_bytes():
    secret, t = new_secret(), arena(1 << 20, seed=2)
    assert keyed_digest(t.view(torch.bfloat16), secret) == keyed_digest(t, secret)
