"""Device memory one process holds, as the driver counts it (NVML), not the device's free memory.

The device's free memory (``cudaMemGetInfo``, NVML's device info) moves with every process on the
GPU: a figure taken as "free before minus free after" around one process's work also counts what
any other process allocated or released meanwhile (a serving worker sizing its KV cache while its
hot spare warms up; the GPU test tier's processes running side by side). NVML's per-process record
(``nvmlDeviceGetComputeRunningProcesses``) is what that one process holds: its CUDA context, its
own allocations (torch's cache included), not memory it only maps from another process (a daemon's
arena shared by file descriptor or CUDA IPC stays the exporter's).

Where NVML cannot tell (no library, a driver that hides other PIDs, a PID namespace that differs
from the driver's), the functions say so with None and the caller falls back to the device's free
memory, naming the fallback in its log.
"""

from __future__ import annotations

import os


def process_device_bytes(pid: int | None = None, index: int = 0) -> int | None:
    """Bytes of device ``index`` that process ``pid`` (default: this one) holds, as NVML counts them;
    0 when the process holds no context there; None when NVML cannot say."""
    held = processes_on_device(index)
    if held is None:
        return None
    return held.get(os.getpid() if pid is None else pid, 0)


def processes_on_device(index: int = 0) -> dict[int, int] | None:
    """{pid: bytes} of every compute process on device ``index`` (PIDs as the driver sees them), or
    None when NVML cannot list them or hides their memory."""
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(_physical_index(index))
        procs = pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
    except Exception:
        return None
    out = {}
    for p in procs:
        used = getattr(p, "usedGpuMemory", None)
        if used is None:  # NVML_VALUE_NOT_AVAILABLE: memory of other processes is hidden from us
            return None
        out[int(p.pid)] = int(used)
    return out


def _physical_index(index: int) -> int:
    """NVML numbers every GPU of the host; CUDA only the visible ones, in CUDA_VISIBLE_DEVICES' order."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").strip()
    if not visible:
        return index
    entries = [e.strip() for e in visible.split(",") if e.strip()]
    entry = entries[index] if index < len(entries) else str(index)
    return int(entry) if entry.isdigit() else index
