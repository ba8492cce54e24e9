"""Device identity: what names a daemon's socket, and what the engine checks the daemon against.

On CUDA it is the GPU's UUID, so the socket follows the physical GPU whatever CUDA_VISIBLE_DEVICES
says. On CPU it is the host's boot id plus the local rank: stable while the host runs, the same in
every container on the host (they share the kernel), and distinct per rank so several CPU "ranks"
can share one machine.
"""

from __future__ import annotations

from pathlib import Path

import torch

BOOT_ID = Path("/proc/sys/kernel/random/boot_id")


def device_identity(device: str, local_rank: int = 0) -> str:
    if device == "cuda":
        props = torch.cuda.get_device_properties(local_rank % torch.cuda.device_count())
        return f"GPU-{props.uuid}"
    boot = BOOT_ID.read_text().strip().split("-")[0] if BOOT_ID.exists() else "host"
    return f"cpu-{boot}-{local_rank}"


def device_arch(device: str, local_rank: int = 0) -> str:
    if device == "cuda":
        major, minor = torch.cuda.get_device_capability(local_rank % torch.cuda.device_count())
        return f"sm_{major}{minor}"
    return "cpu"
