"""Legacy CUDA IPC: one cudaMalloc block exported as a 64-byte handle, through the CUDA runtime that
torch already loaded, called with ctypes.

Why not torch's own sharing (``storage._share_cuda_()``)? It ties the exported memory's lifetime to
reference counters in shared-memory files that importers decrement only when they free cleanly;
measured on the H200, the exporter still held its memory after earlier importers had exited. Here
the daemon allocates the arena with ``cudaMalloc``, exports one ``cudaIpcMemHandle_t`` (sent
base64-encoded inside the JSON reply), and frees it with ``cudaFree`` when the protocol says so.
Importers open the handle once, bind every tensor as a view, and close it when they stop.

The handle names memory by the process that exported it: it cannot be handed to a restarted daemon.
"""

from __future__ import annotations

import base64
import ctypes
import ctypes.util
import os

import torch

from wcache.core.postprocess import ProcessedWeights
from wcache.wire.arena import Arena, MappedArena, arena_size, new_arena_id, plan_layout
from wcache.wire.protocol import ProtocolError, close_fds

ALIGN = 512  # keeps every view aligned for vectorized kernels
IPC_HANDLE_BYTES = 64
LAZY_ENABLE_PEER_ACCESS = 1


class CudaIpcError(RuntimeError):
    pass


class _Handle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * IPC_HANDLE_BYTES)]


def _load_cudart() -> ctypes.CDLL:
    torch.cuda.init()
    # Use the very library torch runs on (same version, same context), found in our own mappings.
    with open("/proc/self/maps") as maps:
        for line in maps:
            path = line.split()[-1] if line.strip() else ""
            if "libcudart.so" in os.path.basename(path):
                return ctypes.CDLL(path)
    name = ctypes.util.find_library("cudart")
    if name:
        return ctypes.CDLL(name)
    raise CudaIpcError("cannot find the CUDA runtime library (libcudart) that torch uses")


_cudart: ctypes.CDLL | None = None


def cudart() -> ctypes.CDLL:
    global _cudart
    if _cudart is None:
        lib = _load_cudart()
        lib.cudaMalloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t]
        lib.cudaFree.argtypes = [ctypes.c_void_p]
        lib.cudaIpcGetMemHandle.argtypes = [ctypes.POINTER(_Handle), ctypes.c_void_p]
        lib.cudaIpcOpenMemHandle.argtypes = [ctypes.POINTER(ctypes.c_void_p), _Handle, ctypes.c_uint]
        lib.cudaIpcCloseMemHandle.argtypes = [ctypes.c_void_p]
        lib.cudaGetErrorName.restype = ctypes.c_char_p
        lib.cudaSetDevice.argtypes = [ctypes.c_int]
        _cudart = lib
    return _cudart


def _check(code: int, what: str) -> None:
    if code != 0:
        name = cudart().cudaGetErrorName(code).decode()
        raise CudaIpcError(f"{what} failed: {name}")


class _ArrayInterface:
    """A device pointer that torch can wrap without copying (``__cuda_array_interface__``)."""

    def __init__(self, ptr: int, size: int):
        self.__cuda_array_interface__ = {"shape": (size,), "typestr": "|u1", "data": (ptr, False),
                                         "version": 3, "strides": None, "stream": None}


def as_tensor(ptr: int, size: int, device: torch.device) -> torch.Tensor:
    return torch.as_tensor(_ArrayInterface(ptr, size), device=device)


def _set_device(device: torch.device) -> None:
    torch.cuda.set_device(device)
    _check(cudart().cudaSetDevice(device.index or 0), "cudaSetDevice")


def malloc(size: int, device: torch.device) -> int:
    _set_device(device)
    ptr = ctypes.c_void_p()
    _check(cudart().cudaMalloc(ctypes.byref(ptr), size), f"cudaMalloc({size})")
    return ptr.value


def free(ptr: int) -> None:
    _check(cudart().cudaFree(ctypes.c_void_p(ptr)), "cudaFree")


def export_handle(ptr: int) -> bytes:
    h = _Handle()
    _check(cudart().cudaIpcGetMemHandle(ctypes.byref(h), ctypes.c_void_p(ptr)), "cudaIpcGetMemHandle")
    return ctypes.string_at(ctypes.addressof(h), IPC_HANDLE_BYTES)  # may contain NUL bytes


def open_handle(handle: bytes, device: torch.device) -> int:
    if len(handle) != IPC_HANDLE_BYTES:
        raise CudaIpcError(f"a CUDA IPC handle is {IPC_HANDLE_BYTES} bytes, got {len(handle)}")
    _set_device(device)
    h = _Handle()
    ctypes.memmove(ctypes.addressof(h), handle, IPC_HANDLE_BYTES)
    ptr = ctypes.c_void_p()
    _check(cudart().cudaIpcOpenMemHandle(ctypes.byref(ptr), h, LAZY_ENABLE_PEER_ACCESS), "cudaIpcOpenMemHandle")
    return ptr.value


def close_handle(ptr: int, device: torch.device) -> None:
    """Unmap a peer's block; from any thread (a copy-mode engine lets go in the background)."""
    _set_device(device)
    _check(cudart().cudaIpcCloseMemHandle(ctypes.c_void_p(ptr)), "cudaIpcCloseMemHandle")


def fill(arena: torch.Tensor, layout, weights: ProcessedWeights) -> None:
    """Copy every tensor to its offset of a device arena (uint8), and wait for the copies."""
    for e in layout.entries:
        t = weights.tensors[e["name"]].contiguous().view(-1).view(torch.uint8)
        arena[e["offset"] : e["offset"] + t.numel()].copy_(t)
    torch.cuda.synchronize(arena.device)


class CudaIpcArena(Arena):
    """The daemon's device arena: one cudaMalloc, exported once as a CUDA IPC handle."""

    kind = "cuda_ipc"

    def __init__(self, layout, arena_id: str, weights_bytes: int, ptr: int, device: torch.device):
        super().__init__(layout, arena_id, weights_bytes)
        self.ptr, self.device = ptr, device
        self.handle = export_handle(ptr)

    @classmethod
    def pack(cls, weights: ProcessedWeights, device: torch.device) -> "CudaIpcArena":
        layout = plan_layout(weights.tensors, ALIGN)
        ptr = malloc(layout.size, device)
        try:
            fill(as_tensor(ptr, layout.size, device), layout, weights)
            return cls(layout, new_arena_id(), weights.nbytes, ptr, device)
        except BaseException:
            free(ptr)
            raise

    @classmethod
    def map(cls, desc: dict, fds: list[int], device: torch.device) -> MappedArena:
        close_fds(fds)
        try:
            handle = base64.b64decode(desc.get("handle", ""), validate=True)
        except (ValueError, TypeError) as e:
            raise ProtocolError(f"bad CUDA IPC handle: {e}") from None
        size = arena_size(desc)
        ptr = open_handle(handle, device)
        return MappedArena(as_tensor(ptr, size, device), lambda: close_handle(ptr, device))

    def tensor(self) -> torch.Tensor:
        return as_tensor(self.ptr, self.size, self.device)

    def descriptor(self) -> dict:
        return {**super().descriptor(), "handle": base64.b64encode(self.handle).decode()}

    def close(self) -> None:
        if self.ptr is not None:
            torch.cuda.synchronize(self.device)
            free(self.ptr)
            self.ptr = None
