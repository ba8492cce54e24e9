"""Device memory of one process or one process tree, as the driver counts it (NVML), for the GPU
tests' memory figures: the device's free memory moves with every other process on the GPU, and the
GPU tier runs its tests side by side (tools/gpu_tier.sh). What a process only maps from another
(a daemon's arena) stays the exporter's (tools/probes/nvml_probe.py shows it on the GPU host).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch

from wcache.core.process_memory import processes_on_device


def process_tree(root: int) -> set[int]:
    """``root`` and every process below it (a launcher and its ranks, an engine and its workers)."""
    kids: dict[int, list[int]] = {}
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            ppid = int((p / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        kids.setdefault(ppid, []).append(int(p.name))
    out, todo = set(), [root]
    while todo:
        pid = todo.pop()
        out.add(pid)
        todo += kids.get(pid, [])
    return out


def tree_bytes(root: int, settle_s: float = 0.5) -> int:
    """What ``root``'s process tree holds on device 0, once two readings ``settle_s`` apart agree
    within 8 MiB (a process still allocating, or a driver still tearing one down)."""
    if torch.cuda.is_initialized():
        torch.cuda.synchronize()
    last = _reading(root)
    for _ in range(60):
        time.sleep(settle_s)
        now = _reading(root)
        if abs(now - last) < 8 << 20:
            return now
        last = now
    return last


def own_bytes() -> int:
    torch.cuda.synchronize()
    return _reading(os.getpid(), tree=False)


def _reading(root: int, tree: bool = True) -> int:
    held = processes_on_device()
    assert held is not None, "NVML cannot list the device's processes and their memory here"
    pids = process_tree(root) if tree else {root}
    return sum(held.get(p, 0) for p in pids)


_BARE = "import torch; torch.empty(1, device='cuda'); print('up', flush=True); input()"


def bare_context_bytes() -> int:
    """What a process that only made a CUDA context (and one tiny tensor) holds on device 0: what
    every daemon and engine pays before its own memory."""
    import subprocess
    import sys

    p = subprocess.Popen([sys.executable, "-c", _BARE], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "up"
        return tree_bytes(p.pid)
    finally:
        p.stdin.close()
        p.wait(timeout=60)
