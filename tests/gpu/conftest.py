"""GPU tests share one card with the subprocesses they start."""

from __future__ import annotations

import gc

import pytest
import torch


@pytest.fixture(autouse=True)
def give_back_cached_device_memory():
    """After each test, this process's allocator returns its cached blocks to the device. Without it
    the blocks of a test that allocated much (the 15 GiB arena hash) stay reserved here, and every
    engine a later test starts at the default --gpu-memory-utilization 0.9 is refused by the free
    memory check at start, rightly: that memory is not free."""
    yield
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        gc.collect()
        torch.cuda.empty_cache()
