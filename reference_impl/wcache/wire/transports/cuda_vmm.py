"""vmm_fd: a CUDA VMM allocation exported as a POSIX file descriptor, through the CUDA driver API
called with ctypes on ``libcuda.so.1`` (no Python package beyond torch).

A legacy CUDA IPC handle names memory by the exporting process, so the importer must reach that
process (upstream's guide: share the PID namespace and /dev/shm). A VMM allocation exported with
``cuMemExportToShareableHandle`` is a file descriptor instead: it travels over the daemon's Unix
socket with SCM_RIGHTS like the CPU arena's memfd, crosses PID/IPC/mount namespaces, and the memory
lives until the last process holding the allocation releases it. That is also why a running engine
can hand it to a restarted daemon (handback.py).

Start-up cost: the driver library and every entry point are resolved once, when this module is
imported, so an engine's first map pays only the driver calls. The calls run in the device's
primary context (the one torch uses), made current on whichever thread calls.
"""

from __future__ import annotations

import ctypes
import os
import threading

import torch

from wcache.core.postprocess import ProcessedWeights
from wcache.wire.arena import Arena, Layout, MappedArena, arena_size, bind_views, manifest, new_arena_id, plan_layout
from wcache.wire.protocol import ProtocolError, close_fds
from wcache.wire.transports.cuda_ipc import ALIGN, as_tensor, fill


class CudaVmmError(RuntimeError):
    pass


# -- cuda.h, as laid out there (tests/gpu/test_vmm_driver.py compiles a check against the header) --
CU_MEM_ALLOCATION_TYPE_PINNED = 1
CU_MEM_LOCATION_TYPE_DEVICE = 1
CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR = 1
CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3
CU_MEM_ALLOC_GRANULARITY_RECOMMENDED = 1

CUresult = ctypes.c_int
CUdevice = ctypes.c_int
CUcontext = ctypes.c_void_p
CUdeviceptr = ctypes.c_uint64  # unsigned long long on every 64-bit platform
CUhandle = ctypes.c_uint64  # CUmemGenericAllocationHandle


class CUmemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class CUmemAllocFlags(ctypes.Structure):
    _fields_ = [("compressionType", ctypes.c_ubyte), ("gpuDirectRDMACapable", ctypes.c_ubyte),
                ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]


class CUmemAllocationProp(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int), ("location", CUmemLocation),
                ("win32HandleMetaData", ctypes.c_void_p), ("allocFlags", CUmemAllocFlags)]


class CUmemAccessDesc(ctypes.Structure):
    _fields_ = [("location", CUmemLocation), ("flags", ctypes.c_int)]


_P = ctypes.POINTER
_SIGNATURES = {
    "cuInit": [ctypes.c_uint],
    "cuDeviceGet": [_P(CUdevice), ctypes.c_int],
    "cuDevicePrimaryCtxRetain": [_P(CUcontext), CUdevice],
    "cuCtxSetCurrent": [CUcontext],
    "cuCtxSynchronize": [],
    "cuGetErrorName": [CUresult, _P(ctypes.c_char_p)],
    "cuMemGetAllocationGranularity": [_P(ctypes.c_size_t), _P(CUmemAllocationProp), ctypes.c_int],
    "cuMemCreate": [_P(CUhandle), ctypes.c_size_t, _P(CUmemAllocationProp), ctypes.c_ulonglong],
    "cuMemExportToShareableHandle": [ctypes.c_void_p, CUhandle, ctypes.c_int, ctypes.c_ulonglong],
    "cuMemImportFromShareableHandle": [_P(CUhandle), ctypes.c_void_p, ctypes.c_int],
    "cuMemAddressReserve": [_P(CUdeviceptr), ctypes.c_size_t, ctypes.c_size_t, CUdeviceptr, ctypes.c_ulonglong],
    "cuMemAddressFree": [CUdeviceptr, ctypes.c_size_t],
    "cuMemMap": [CUdeviceptr, ctypes.c_size_t, ctypes.c_size_t, CUhandle, ctypes.c_ulonglong],
    "cuMemSetAccess": [CUdeviceptr, ctypes.c_size_t, _P(CUmemAccessDesc), ctypes.c_size_t],
    "cuMemUnmap": [CUdeviceptr, ctypes.c_size_t],
    "cuMemRelease": [CUhandle],
}


class _Driver:
    """The driver's entry points, resolved once."""

    def __init__(self, lib: ctypes.CDLL):
        for name, argtypes in _SIGNATURES.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = argtypes, CUresult
            setattr(self, name, fn)


def _load() -> tuple[_Driver | None, str]:
    try:
        return _Driver(ctypes.CDLL("libcuda.so.1")), ""
    except (OSError, AttributeError) as e:  # no driver here, or one too old for the VMM API
        return None, str(e)


_DRIVER, _WHY_NOT = _load()


def available() -> bool:
    """Whether this host's CUDA driver offers the VMM calls vmm_fd needs."""
    return _DRIVER is not None


def driver() -> _Driver:
    if _DRIVER is None:
        raise CudaVmmError(f"the vmm_fd transport needs the CUDA driver library libcuda.so.1 ({_WHY_NOT})")
    return _DRIVER


def _ok(code: int, what: str) -> None:
    if code != 0:
        name = ctypes.c_char_p()
        driver().cuGetErrorName(code, ctypes.byref(name))
        raise CudaVmmError(f"{what} failed: {(name.value or b'CUresult %d' % code).decode()}")


_contexts: dict[int, int] = {}
_contexts_lock = threading.Lock()


def _current(index: int) -> None:
    """Make the device's primary context (torch's) current on this thread, retaining it once."""
    cu = driver()
    ctx = _contexts.get(index)
    if ctx is None:
        with _contexts_lock:
            ctx = _contexts.get(index)
            if ctx is None:
                _ok(cu.cuInit(0), "cuInit")
                dev, c = CUdevice(), CUcontext()
                _ok(cu.cuDeviceGet(ctypes.byref(dev), index), "cuDeviceGet")
                _ok(cu.cuDevicePrimaryCtxRetain(ctypes.byref(c), dev), "cuDevicePrimaryCtxRetain")
                ctx = _contexts[index] = c.value
    _ok(cu.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")


def _prop(index: int) -> CUmemAllocationProp:
    p = CUmemAllocationProp()
    p.type = CU_MEM_ALLOCATION_TYPE_PINNED
    p.location.type = CU_MEM_LOCATION_TYPE_DEVICE
    p.location.id = index
    p.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
    return p


_granularity: dict[int, int] = {}


def granularity(device: torch.device) -> int:
    """The driver's recommended allocation granularity: every VMM arena's size is a multiple of it."""
    index = device.index or 0
    if index not in _granularity:
        _current(index)
        g = ctypes.c_size_t()
        _ok(driver().cuMemGetAllocationGranularity(ctypes.byref(g), ctypes.byref(_prop(index)),
                                                   CU_MEM_ALLOC_GRANULARITY_RECOMMENDED),
            "cuMemGetAllocationGranularity")
        _granularity[index] = g.value
    return _granularity[index]


def _map(handle: int, size: int, index: int) -> int:
    """Reserve an address range, map the allocation there and allow read-write access. On failure
    the range is unmapped and freed again (the caller still owns ``handle``)."""
    cu = driver()
    ptr = CUdeviceptr()
    _ok(cu.cuMemAddressReserve(ctypes.byref(ptr), size, 0, 0, 0), f"cuMemAddressReserve({size})")
    mapped = False
    try:
        _ok(cu.cuMemMap(ptr, size, 0, handle, 0), f"cuMemMap({size})")
        mapped = True
        access = CUmemAccessDesc()
        access.location.type = CU_MEM_LOCATION_TYPE_DEVICE
        access.location.id = index
        # Read-write: the driver refuses read-only device mappings (cudaErrorInvalidValue, measured).
        access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        _ok(cu.cuMemSetAccess(ptr, size, ctypes.byref(access), 1), "cuMemSetAccess")
    except BaseException:
        if mapped:
            cu.cuMemUnmap(ptr, size)
        cu.cuMemAddressFree(ptr, size)
        raise
    return ptr.value


class Allocation:
    """One VMM allocation mapped into this process; ``close`` unmaps and drops our reference."""

    def __init__(self, handle: int, ptr: int, size: int, device: torch.device):
        self.handle, self.ptr, self.size, self.device = handle, ptr, size, device

    def tensor(self) -> torch.Tensor:
        return as_tensor(self.ptr, self.size, self.device)

    def close(self) -> None:
        if self.handle is None:
            return
        cu = driver()
        # Any thread may release (the daemon answers on connection threads): make the context
        # current here, and let work that reads the memory finish before it goes.
        _current(self.device.index or 0)
        _ok(cu.cuCtxSynchronize(), "cuCtxSynchronize")
        _ok(cu.cuMemUnmap(self.ptr, self.size), "cuMemUnmap")
        _ok(cu.cuMemAddressFree(self.ptr, self.size), "cuMemAddressFree")
        handle, self.handle = self.handle, None
        _ok(cu.cuMemRelease(handle), "cuMemRelease")


def create(size: int, device: torch.device) -> Allocation:
    """A new allocation of ``size`` bytes (a multiple of ``granularity``), mapped here."""
    index = device.index or 0
    gran = granularity(device)
    if size <= 0 or size % gran:
        raise CudaVmmError(f"a VMM allocation is a positive multiple of {gran} bytes, not {size}")
    _current(index)
    handle = CUhandle()
    _ok(driver().cuMemCreate(ctypes.byref(handle), size, ctypes.byref(_prop(index)), 0), f"cuMemCreate({size})")
    try:
        return Allocation(handle.value, _map(handle.value, size, index), size, device)
    except BaseException:
        driver().cuMemRelease(handle.value)
        raise


def export_fd(alloc: Allocation) -> int:
    fd = ctypes.c_int(-1)
    _current(alloc.device.index or 0)
    _ok(driver().cuMemExportToShareableHandle(ctypes.byref(fd), alloc.handle, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                                              0), "cuMemExportToShareableHandle")
    os.set_inheritable(fd.value, False)  # a child process must not keep the memory alive
    return fd.value


def import_fd(fd: int, size: int, device: torch.device) -> Allocation:
    """Map an exported allocation; the descriptor is closed (the import holds the reference)."""
    index = device.index or 0
    handle = CUhandle()
    try:
        _current(index)
        _ok(driver().cuMemImportFromShareableHandle(ctypes.byref(handle), ctypes.c_void_p(fd),
                                                    CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR),
            "cuMemImportFromShareableHandle")
    finally:
        os.close(fd)
    try:
        return Allocation(handle.value, _map(handle.value, size, index), size, device)
    except BaseException:
        driver().cuMemRelease(handle.value)
        raise


class VmmFdArena(Arena):
    """The daemon's device arena as a CUDA VMM allocation, exported once as a file descriptor."""

    kind = "vmm_fd"
    handed_back = True

    def __init__(self, layout: Layout, arena_id: str, weights_bytes: int, alloc: Allocation, fd: int):
        super().__init__(layout, arena_id, weights_bytes)
        self.alloc, self.fd, self.device = alloc, fd, alloc.device

    @classmethod
    def pack(cls, weights: ProcessedWeights, device: torch.device) -> "VmmFdArena":
        # The layout's size is the allocation's: descriptor, get_memory and an adopting daemon agree.
        layout = plan_layout(weights.tensors, ALIGN, granularity(device))
        alloc = create(layout.size, device)
        try:
            fill(alloc.tensor(), layout, weights)
            return cls(layout, new_arena_id(), weights.nbytes, alloc, export_fd(alloc))
        except BaseException:
            alloc.close()
            raise

    @classmethod
    def adopt(cls, desc: dict, layout: Layout, fd: int, device: torch.device) -> "VmmFdArena":
        """Serve a VMM allocation an engine handed back: import it (our own reference, so the memory
        lives while this daemon does) and pass the same descriptor on to later engines."""
        alloc = import_fd(os.dup(fd), layout.size, device)
        try:
            bind_views(alloc.tensor(), manifest(layout))
        except ProtocolError:
            alloc.close()
            raise
        return cls(layout, desc["id"], layout.weights_bytes, alloc, fd)

    @classmethod
    def map(cls, desc: dict, fds: list[int], device: torch.device) -> MappedArena:
        try:
            if len(fds) != 1:
                raise ProtocolError(f"expected one CUDA VMM descriptor for a {device} engine, got {len(fds)}")
            size = arena_size(desc)
        except ProtocolError:
            close_fds(fds)
            raise
        alloc = import_fd(fds[0], size, device)
        return MappedArena(alloc.tensor(), alloc.close)

    def tensor(self) -> torch.Tensor:
        return self.alloc.tensor()

    def fds(self) -> list[int]:
        return [self.fd]

    def close(self) -> None:
        # Drops the daemon's reference; the memory returns once every importer has released it too.
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
            self.alloc.close()
