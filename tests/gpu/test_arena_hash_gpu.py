"""The keyed arena hash on a GPU: the same digest as on the CPU, and the time it takes for 15 GiB
(the llama-8b arena a vmm_fd daemon verifies before serving an adopted arena)."""

from __future__ import annotations

import time

import pytest
import torch
from wcache.daemon.arena_hash import keyed_digest, new_secret

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run `make test-gpu` on a GPU host)"),
]


def test_the_gpu_digest_is_the_cpu_digest():
    secret = new_secret()
    t = torch.randint(0, 256, (64 << 20,), dtype=torch.uint8)
    assert keyed_digest(t.cuda(), secret) == keyed_digest(t, secret)


def test_15_gib_verify_within_half_a_second():
    secret = new_secret()
    t = torch.empty(15 << 30, dtype=torch.uint8, device="cuda")
    t.random_(0, 256)
    keyed_digest(t[: 1 << 30], secret)  # the first call's kernels load once per process
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    keyed_digest(t, secret)
    seconds = time.perf_counter() - t0
    print(f"keyed hash of 15 GiB on {torch.cuda.get_device_name(0)}: {seconds:.3f} s")
    assert seconds <= 0.5, seconds
