"""The engine's CUDA context, made while Python imports torch and the engine.

An engine start pays, one after the other, the interpreter, ``import torch`` (seconds) and the CUDA
context (its first CUDA call: ~0.17 s on an H200). Nothing in the context needs torch: it is the
driver's *primary context* of the device, which the CUDA runtime (torch's) takes over as it is when
torch first touches the device. So ``wcache serve`` asks the driver for it on a thread of its own as
soon as the command line says CUDA, before the imports; ctypes lets go of the GIL inside each driver
call, so the imports go on meanwhile. The engine's first CUDA call then finds the context made.

The thread retains device 0's primary context: the device this process's engine rank uses (its
local rank 0, after CUDA_VISIBLE_DEVICES, which the driver honours as torch does). Any failure
(no driver, no device) is left for torch to report in its own words at its first CUDA call.
"""

from __future__ import annotations

import ctypes
import importlib.util
import threading
from pathlib import Path

_started: threading.Thread | None = None


def wants_cuda(argv: list[str]) -> bool:
    """Whether `wcache serve argv` will run on CUDA: ``--device cuda``, or ``auto`` (the default)
    with a CUDA build of torch installed (a CPU build picks the CPU even beside a GPU, and a
    context made for nothing would hold device memory). Not the ``--respawn`` supervisor: its
    workers are processes of their own."""
    if "--respawn" in argv or {"-h", "--help"} & set(argv):
        return False
    device = "auto"
    for i, arg in enumerate(argv):
        if arg == "--device" and i + 1 < len(argv):
            device = argv[i + 1]
        elif arg.startswith("--device="):
            device = arg.split("=", 1)[1]
    return device == "cuda" or device == "auto" and _torch_has_cuda()


def _torch_has_cuda() -> bool:
    """Whether the installed torch is a CUDA build, found without importing it (that is the wait
    this module overlaps)."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return False
    return any((Path(d) / "lib" / "libtorch_cuda.so").exists() for d in spec.submodule_search_locations)


def start(argv: list[str]) -> threading.Thread | None:
    """Start making the context (once per process) where ``argv`` may run on CUDA."""
    global _started
    if _started is None and wants_cuda(argv):
        _started = threading.Thread(target=_retain_primary_context, name="wcache-cuda-context", daemon=True)
        _started.start()
    return _started


def wait() -> None:
    """Until the context is made (or the attempt has given up)."""
    if _started is not None:
        _started.join()


def _retain_primary_context() -> None:
    try:
        cu = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return  # no driver: a CPU host, or torch says what is missing
    dev, count, ctx = ctypes.c_int(), ctypes.c_int(), ctypes.c_void_p()
    if cu.cuInit(0) != 0 or cu.cuDeviceGetCount(ctypes.byref(count)) != 0 or count.value < 1:
        return
    if cu.cuDeviceGet(ctypes.byref(dev), 0) == 0:
        cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev)  # held for the process's life, as torch holds it
