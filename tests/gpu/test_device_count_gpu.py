"""The device questions on a restarted engine's way to its weights go to the driver, not NVML
(core/device.py cuda_device_count): until torch makes its own CUDA context, torch.cuda.device_count()
loads libnvidia-ml and calls nvmlInit on every call, and the socket's name, the cache key and the
check of the daemon's reply each asked it."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run `make test-gpu` on a GPU host)"),
]

# A fresh process, as a restarted engine is: torch imported, its CUDA not initialised.
PROBE = """
import json, sys, time
import torch
from wcache.core.device import cuda_device_count, device_arch, device_identity
t = time.perf_counter()
answers = [cuda_device_count(), device_identity("cuda", 0), device_arch("cuda", 0)]
asked = time.perf_counter() - t
nvml = "libnvidia-ml" in open("/proc/self/maps").read()
torch_initialised = torch.cuda.is_initialized()
props = torch.cuda.get_device_properties(0)
print(json.dumps({"answers": answers, "nvml": nvml, "torch_initialised": torch_initialised, "asked_ms": asked * 1e3,
                  "torch": [torch.cuda.device_count(), f"GPU-{props.uuid}", f"sm_{props.major}{props.minor}"]}))
"""


def test_the_driver_answers_as_torch_does_without_nvml():
    import json

    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    print(f"count, identity and arch asked of the driver in {got['asked_ms']:.2f} ms")
    assert got["answers"] == got["torch"]
    assert got["torch_initialised"] is False  # the answers did not need torch's CUDA
    assert got["nvml"] is False, "a device question loaded NVML"


def test_the_launcher_resolves_auto_to_cuda_and_names_the_gpu_without_torch(tmp_path, wcache_env, tiny_model):
    # `wcache preload`'s launcher imports no torch (each replica of a fan-out paid a second import):
    # --device auto and the socket's name come from the driver (core/device.py).
    import re
    from pathlib import Path

    from procs import Processes, child_pids

    p = Processes(tmp_path, wcache_env, device="auto")
    try:
        daemon = p.preload(tiny_model)
        assert re.search(r"into a (cuda_ipc|vmm_fd) arena", daemon.log())  # auto resolved to cuda
        assert "libtorch" not in Path(f"/proc/{daemon.pid}/maps").read_text()
        ranks = child_pids(daemon.pid)
        assert ranks and all("libtorch" in Path(f"/proc/{r}/maps").read_text() for r in ranks)
    finally:
        p.stop_all()
