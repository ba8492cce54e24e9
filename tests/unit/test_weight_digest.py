"""The replica's digest check (weight_digest.Checker): hashing the bytes a piece at a time as they
land gives the digests the source computes over whole chunks, whatever the pieces' sizes, and a
changed byte, a short stream or a digest list of another arena is named by its chunk."""

from __future__ import annotations

import pytest
import torch

from wcache.daemon import weight_digest

CHUNK = 1 << 20


def header(data: torch.Tensor, algorithm: str) -> dict:
    return {"algorithm": algorithm, "chunk_bytes": CHUNK, "chunks": weight_digest.digests(data, algorithm, None, CHUNK)}


def fed(data: torch.Tensor, head: dict, piece: int) -> weight_digest.Checker:
    checker = weight_digest.Checker(None, head, data.numel())
    view = memoryview(data.numpy())
    for a in range(0, data.numel(), piece):
        checker.feed(view[a:a + piece])
    return checker


@pytest.mark.parametrize("algorithm", weight_digest.CPU_ALGORITHMS)
@pytest.mark.parametrize("piece", [4096, 3 * CHUNK // 7, CHUNK, 4 * CHUNK])
def test_pieces_of_any_size_give_the_sources_digests(algorithm, piece):
    data = torch.randint(0, 256, (3 * CHUNK + 12345,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    assert fed(data, header(data, algorithm), piece).bad() == []


@pytest.mark.parametrize("algorithm", weight_digest.CPU_ALGORITHMS)
def test_a_changed_byte_and_a_short_stream_are_named_by_chunk(algorithm):
    data = torch.randint(0, 256, (3 * CHUNK + 99,), dtype=torch.uint8, generator=torch.Generator().manual_seed(2))
    head = header(data, algorithm)
    changed = data.clone()
    changed[CHUNK + 5] ^= 1
    assert fed(changed, head, 65536).bad() == [1]
    short = weight_digest.Checker(None, head, data.numel())
    short.feed(memoryview(data.numpy())[: 2 * CHUNK + 7])
    assert short.bad() == [2, 3]
