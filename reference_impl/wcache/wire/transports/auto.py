"""Which arena a daemon serves: the one place ``--weight-cache-transport auto`` is resolved."""

from __future__ import annotations

import torch

from wcache.wire.transports import cuda_vmm

TRANSPORTS = ("auto", "cuda_ipc", "vmm_fd")  # the values of --weight-cache-transport and the loader's key


def resolve_transport(choice: str, device: torch.device) -> str:
    """The arena kind: memfd on CPU whatever the choice; on CUDA vmm_fd when the driver offers the
    VMM calls (``auto``), else legacy CUDA IPC."""
    if device.type != "cuda":
        return "memfd"
    if choice == "auto":
        return "vmm_fd" if cuda_vmm.available() else "cuda_ipc"
    if choice not in TRANSPORTS:
        raise ValueError(f"unknown transport {choice!r}; choose one of {list(TRANSPORTS)}")
    return choice
