"""Device identity: what names a daemon's socket, and what the engine checks the daemon against.

On CUDA it is the GPU's UUID, so the socket follows the physical GPU whatever CUDA_VISIBLE_DEVICES
says. On CPU it is the host's boot id plus the local rank: stable while the host runs, the same in
every container on the host (they share the kernel), and distinct per rank so several CPU "ranks"
can share one machine.

Asked of the CUDA driver (ctypes), not of torch: `wcache preload`'s launcher names its ranks'
sockets and resolves ``--device auto`` without importing torch. torch answers only where the driver
cannot, imported then.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

BOOT_ID = Path("/proc/sys/kernel/random/boot_id")
_CC_MAJOR, _CC_MINOR = 75, 76  # CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR / _MINOR (cuda.h)


def device_identity(device: str, local_rank: int = 0) -> str:
    if device == "cuda":
        return _cuda_device(local_rank % cuda_device_count())[0]
    boot = BOOT_ID.read_text().strip().split("-")[0] if BOOT_ID.exists() else "host"
    return f"cpu-{boot}-{local_rank}"


def device_arch(device: str, local_rank: int = 0) -> str:
    if device == "cuda":
        return _cuda_device(local_rank % cuda_device_count())[1]
    return "cpu"


def cuda_device_count() -> int:
    """The CUDA devices this process sees, asked of the driver, which applies CUDA_VISIBLE_DEVICES
    as torch does. Until torch has made its own CUDA context, torch.cuda.device_count() asks NVML
    instead, loading its library and calling nvmlInit on every call: a restarted engine asks up to
    four times on its way to its weights (the socket's name, the cache key, the check of the
    daemon's reply, the mapping), and the handoff is a few milliseconds long. torch's answer where the driver gives none."""
    try:
        return _driver_device_count()
    except (OSError, AttributeError):
        import torch

        return torch.cuda.device_count()


def cuda_available() -> bool:
    """torch.cuda.is_available()'s answer. A driver that does not load, initialise or count gives
    torch no device either (it works through the same driver)."""
    try:
        return _driver_device_count() > 0
    except OSError:
        return False
    except AttributeError:
        import torch

        return torch.cuda.is_available()


@functools.lru_cache(maxsize=None)
def _driver():
    """libcuda, initialised (once: cuInit is cheap again but the library's lookup is not)."""
    cu = ctypes.CDLL("libcuda.so.1")
    if (rc := cu.cuInit(0)) != 0:
        raise OSError(f"CUDA driver error {rc} initialising")
    return cu


@functools.lru_cache(maxsize=None)
def _driver_device_count() -> int:
    # Cached: the devices a process sees are fixed once the driver is initialised.
    count = ctypes.c_int()
    if (rc := _driver().cuDeviceGetCount(ctypes.byref(count))) != 0:
        raise OSError(f"CUDA driver error {rc} counting devices")
    return count.value


@functools.lru_cache(maxsize=None)
def _cuda_device(index: int) -> tuple[str, str]:
    """(identity, arch) of CUDA device ``index``. Asked of the driver, three attributes: torch's
    get_device_properties fills in every property of the device, on a restarted engine's way to its
    weights (its cache key). torch's answer where the driver cannot give one."""
    try:
        return _from_driver(index)
    except (OSError, AttributeError):
        import torch

        props = torch.cuda.get_device_properties(index)
        return torch_identity(props), f"sm_{props.major}{props.minor}"


def torch_identity(props) -> str:
    return f"GPU-{props.uuid}"


def _from_driver(index: int) -> tuple[str, str]:
    cu = _driver()
    dev, major, minor = ctypes.c_int(), ctypes.c_int(), ctypes.c_int()
    uuid = (ctypes.c_ubyte * 16)()
    # _v2: a MIG instance's own UUID, as the runtime's device properties give it.
    for rc in (cu.cuDeviceGet(ctypes.byref(dev), index), cu.cuDeviceGetUuid_v2(uuid, dev),
               cu.cuDeviceGetAttribute(ctypes.byref(major), _CC_MAJOR, dev),
               cu.cuDeviceGetAttribute(ctypes.byref(minor), _CC_MINOR, dev)):
        if rc != 0:
            raise OSError(f"CUDA driver error {rc} describing device {index}")
    h = bytes(uuid).hex()
    return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}", f"sm_{major.value}{minor.value}"
