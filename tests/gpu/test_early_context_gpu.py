"""`wcache serve` makes the CUDA context on a thread while it imports (engine/worker/early_context.py): on a
GPU, the driver's primary context is active before torch is imported, and torch then runs on it."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run `make test-gpu` on a GPU host)"),
]

# A fresh process: the thread starts, and once it is done the primary context of device 0 is active
# while torch has not been imported at all; then torch computes on it.
PROBE = """
import ctypes, sys
from wcache.engine.worker import early_context
early_context.start(["serve", "model", "--device", "cuda"])
early_context.wait()
assert "torch" not in sys.modules
cu = ctypes.CDLL("libcuda.so.1")
dev, flags, active = ctypes.c_int(), ctypes.c_uint(), ctypes.c_int()
assert cu.cuInit(0) == 0  # makes no context
assert cu.cuDeviceGet(ctypes.byref(dev), 0) == 0
assert cu.cuDevicePrimaryCtxGetState(dev, ctypes.byref(flags), ctypes.byref(active)) == 0
import torch
print(active.value, float((torch.ones(4, device="cuda") * 2).sum()))
"""


def test_the_context_is_made_before_torch_is_imported():
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["1", "8.0"]


def test_a_cpu_engine_makes_none():
    out = subprocess.run([sys.executable, "-c", PROBE.replace('"cuda"]', '"cpu"]')], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["0", "8.0"]
