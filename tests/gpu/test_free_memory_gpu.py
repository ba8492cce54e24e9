"""The engine's memory failures on a real GPU end in one named line and exit status 2, never a
traceback: the start check (vLLM's) that refuses when another process holds memory the budget counts
on, and a CUDA out-of-memory while the KV cache is sized and allocated.

Cheap beside other tests on one card: the holder takes 4 GiB for a few seconds, and the engines
allocate at most a few GiB before they stop."""

from __future__ import annotations

import re
import socket
import subprocess
import sys

import pytest
import torch
from procs import Processes

from wcache.core.checkpoint import make_checkpoint
from wcache.core.config import EngineConfig
from wcache.engine.core.engine import Engine
from wcache.engine.worker.runner import EngineOptions

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device; run `make test-gpu` on one"),
]
GiB = 1 << 30
HELD = 4 * GiB
# Another process on the same GPU: it holds HELD bytes until its stdin closes.
HOLDER = f"""
import sys, torch
held = torch.empty({HELD}, dtype=torch.uint8, device="cuda")
torch.cuda.synchronize()
print("held", flush=True)
sys.stdin.read()
"""
# An engine whose allocator may take only 1 GiB of the card (a real CUDA out-of-memory past it) while
# its budget holds 6 GiB, and whose 8192 slots of 512 tokens want a 4 GiB KV cache.
OUT_OF_MEMORY = """
import sys, torch
torch.cuda.set_per_process_memory_fraction({fraction})
from wcache.cli import main
sys.exit(main({argv!r}))
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_argv(model, utilization: float, *more: str) -> list[str]:
    return ["serve", str(model), "--device", "cuda", "--port", str(free_port()), "--no-enable-autotune",
            "--gpu-memory-utilization", f"{utilization:.4f}", *more]


def one_error_line(out: subprocess.CompletedProcess, start: str) -> str:
    assert out.returncode == 2, out.stderr[-3000:]
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    lines = [line for line in out.stderr.splitlines() if start in line]
    assert len(lines) == 1, out.stderr[-3000:]
    return lines[0]


def test_memory_held_by_another_process_refuses_the_start(tiny_model, wcache_env):
    """A budget of the card's total less 2 GiB, with slots enough (262,144 of 512 tokens: 128 GiB) that
    the KV cache takes all of it, while another process holds 4 GiB: the plan cannot be had, so the
    engine refuses at start, naming both figures and a utilization that fits. Without the check it
    failed in a CUDA out-of-memory."""
    total = torch.cuda.mem_get_info()[1]
    utilization = 1 - 2 * GiB / total
    holder = subprocess.Popen([sys.executable, "-c", HOLDER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True, env=wcache_env)
    try:
        assert holder.stdout.readline().strip() == "held"
        out = subprocess.run([sys.executable, "-m", "wcache.cli",
                              *serve_argv(tiny_model, utilization, "--max-num-seqs", "262144")],
                             capture_output=True, text=True, env=wcache_env, timeout=240)
    finally:
        holder.stdin.close()
        holder.wait(timeout=60)
    line = one_error_line(out, "Free memory on device")
    m = re.search(r"Free memory on device \(([\d.]+)/([\d.]+) GiB\) on startup is less than this engine still "
                  r"needs \(([\d.]+) GiB for its KV cache, CUDA graphs and activations, within GPU memory "
                  r"utilization [\d.]+, ([\d.]+) GiB\)\. Decrease GPU memory utilization or reduce GPU memory "
                  r"used by other processes\. --gpu-memory-utilization ([\d.]+) fits what is free now", line)
    assert m, line
    free, shown_total, needed, budget, fits = map(float, m.groups())
    assert free < needed <= budget
    assert abs(shown_total - total / GiB) < 0.01
    assert free <= shown_total - HELD / GiB and budget > free
    assert fits < utilization


def test_a_cuda_out_of_memory_while_sizing_is_one_named_line(tiny_model, wcache_env):
    total = torch.cuda.mem_get_info()[1]
    argv = serve_argv(tiny_model, 6 * GiB / total, "--max-num-seqs", "8192")
    code = OUT_OF_MEMORY.format(fraction=GiB / total, argv=argv)
    # The allocator's fraction is this process's own: the engine sizes its KV cache here only in one
    # process (with two, the core is a child that never saw it, started, and the run hung to its timeout).
    one_process = {**wcache_env, "WCACHE_ENABLE_V1_MULTIPROCESSING": "0"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=one_process, timeout=240)
    line = one_error_line(out, "CUDA out of memory while")
    assert "CUDA out of memory while sizing and allocating the KV cache (" in line
    assert line.endswith("): memory outside the budget (CUDA contexts, other processes) took the rest. Lower "
                         "--gpu-memory-utilization (a smaller KV cache), lower --max-model-len (a smaller activation "
                         "peak), or reduce GPU memory used by other processes")


def test_a_zero_copy_engine_is_not_refused_for_the_daemons_weights(tmp_path, wcache_env):
    """The normal zero_copy start: the daemon's weights are on the device before the engine starts,
    so not free, yet inside the engine's budget. A budget of the free memory plus half the weights
    starts, because the check counts the mapped weights; comparing free memory with the whole
    budget refused it. The engine runs in this process, so no second CUDA context moves the figures."""
    model = make_checkpoint(tmp_path / "small", "small")  # about 500 MB of weights
    weights = sum(f.stat().st_size for f in model.glob("*.safetensors"))
    daemons = Processes(tmp_path, wcache_env, device="cuda")
    try:
        daemons.preload(model)
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info()
        budget = free + weights * 0.45
        engine = Engine.start(EngineConfig.build(str(model), device="cuda"),
                              EngineOptions("ipc_cache", gpu_memory_utilization=budget / total, max_num_seqs=4,
                                            enable_autotune=False))
        try:
            assert engine.memory.external_weights > weights * 0.9
            assert engine.memory.budget > free
        finally:
            engine.close()
    finally:
        daemons.stop_all()
