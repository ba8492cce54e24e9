"""engine/worker/row_floors.py's rule, on CPU: a kernel's floor is the fewest rows from which its rows equal
the whole tile's at every bucket; the GPU check itself is tests/gpu/test_row_buckets_gpu.py."""

from __future__ import annotations

import torch
from wcache.engine.worker import row_floors
from wcache.model.llama import at_least_rows


def test_buckets_are_powers_of_two_then_the_tile():
    assert row_floors.buckets(64) == [1, 2, 4, 8, 16, 32, 64]
    assert row_floors.buckets(5) == [1, 2, 4, 5]
    assert row_floors.buckets(1) == [1]


def test_a_row_dependent_kernel_gets_the_floor_from_which_it_agrees_and_padding_keeps_its_rows():
    sizes = row_floors.buckets(64)
    x = torch.randn(64, 32)
    assert row_floors.floor_of(lambda t: t * 2, x, sizes) == 1
    # sums a row differently below 16 rows (as a kernel chosen by the row count might)
    odd = lambda t: t + (t.shape[0] < 16)
    assert row_floors.floor_of(odd, x, sizes) == 16
    assert row_floors.floor_of(lambda t: t + (t.shape[0] == 8), x, sizes) == 16  # the lowest agreeing run
    assert torch.equal(at_least_rows(x[:3], odd, 16), odd(x)[:3])
    assert not torch.equal(odd(x[:3]), odd(x)[:3])
