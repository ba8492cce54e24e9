"""CUDA virtual memory management: an arena exported as a POSIX file descriptor.

A legacy CUDA IPC handle names memory by the exporting process, so the importer must reach that
process (upstream's guide: share the PID namespace and /dev/shm). A VMM allocation exported with
``cuMemExportToShareableHandle`` is a file descriptor instead: it travels over the daemon's Unix
socket with SCM_RIGHTS like the CPU arena's memfd, crosses PID/IPC/mount namespaces, and the
memory lives until the last process holding the allocation releases it. Importing also costs
about a millisecond for any size (measured on the H200), where opening a legacy handle grows
with the allocation. Uses cuda-python's driver bindings (``cuda-bindings``), imported lazily:
only a CUDA daemon or engine that chooses this transport needs them.
"""

from __future__ import annotations

import os

import torch

from wcache.wire.cuda_ipc import as_tensor


class CudaVmmError(RuntimeError):
    pass


def _driver():
    try:
        from cuda.bindings import driver as cu
    except ImportError:
        try:
            from cuda import cuda as cu  # cuda-python < 12.6 layout
        except ImportError:
            raise CudaVmmError("the vmm_fd transport needs cuda-python's driver bindings "
                               "(pip install cuda-bindings)") from None
    return cu


def available() -> bool:
    try:
        _driver()
        return True
    except CudaVmmError:
        return False


def _ok(result, what: str):
    err, *rest = result if isinstance(result, tuple) else (result,)
    if int(err) != 0:
        cu = _driver()
        name = cu.cuGetErrorName(err)[1]
        raise CudaVmmError(f"{what} failed: {name.decode() if isinstance(name, bytes) else name}")
    return rest[0] if len(rest) == 1 else rest


def _prop(cu, device_index: int):
    p = cu.CUmemAllocationProp()
    p.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    p.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    p.location.id = device_index
    p.requestedHandleTypes = cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
    return p


def _map(cu, handle, size: int, device_index: int) -> int:
    ptr = _ok(cu.cuMemAddressReserve(size, 0, 0, 0), "cuMemAddressReserve")
    _ok(cu.cuMemMap(ptr, size, 0, handle, 0), "cuMemMap")
    access = cu.CUmemAccessDesc()
    access.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    access.location.id = device_index
    # Read-write: the driver refuses read-only device mappings (cudaErrorInvalidValue, measured).
    access.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    _ok(cu.cuMemSetAccess(ptr, size, [access], 1), "cuMemSetAccess")
    return int(ptr)


class Allocation:
    """One VMM allocation mapped into this process; ``close`` unmaps and drops our reference."""

    def __init__(self, handle, ptr: int, size: int, device: torch.device):
        self.handle, self.ptr, self.size, self.device = handle, ptr, size, device

    def tensor(self, device: torch.device) -> torch.Tensor:
        return as_tensor(self.ptr, self.size, device)

    def close(self) -> None:
        if self.handle is None:
            return
        cu = _driver()
        # Any thread may release (the daemon answers on connection threads): make the device's
        # primary context current here before the driver calls.
        torch.cuda.set_device(self.device)
        torch.cuda.synchronize(self.device)
        _ok(cu.cuMemUnmap(self.ptr, self.size), "cuMemUnmap")
        _ok(cu.cuMemAddressFree(self.ptr, self.size), "cuMemAddressFree")
        _ok(cu.cuMemRelease(self.handle), "cuMemRelease")
        self.handle = None


def granularity(device: torch.device) -> int:
    cu = _driver()
    torch.empty(0, device=device)  # make sure the primary context exists
    _ok(cu.cuInit(0), "cuInit")
    flag = cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED
    return int(_ok(cu.cuMemGetAllocationGranularity(_prop(cu, device.index or 0), flag), "cuMemGetAllocationGranularity"))


def create(size: int, device: torch.device) -> Allocation:
    cu = _driver()
    gran = granularity(device)
    size = -(-size // gran) * gran
    handle = _ok(cu.cuMemCreate(size, _prop(cu, device.index or 0), 0), f"cuMemCreate({size})")
    return Allocation(handle, _map(cu, handle, size, device.index or 0), size, device)


def export_fd(alloc: Allocation) -> int:
    cu = _driver()
    kind = cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
    return int(_ok(cu.cuMemExportToShareableHandle(alloc.handle, kind, 0), "cuMemExportToShareableHandle"))


def import_fd(fd: int, size: int, device: torch.device) -> Allocation:
    """Map an exported allocation; the descriptor is closed (the import holds the reference)."""
    cu = _driver()
    try:
        torch.empty(0, device=device)
        _ok(cu.cuInit(0), "cuInit")
        kind = cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        handle = _ok(cu.cuMemImportFromShareableHandle(fd, kind), "cuMemImportFromShareableHandle")
    finally:
        os.close(fd)
    try:
        return Allocation(handle, _map(cu, handle, size, device.index or 0), size, device)
    except CudaVmmError:
        cu.cuMemRelease(handle)
        raise
