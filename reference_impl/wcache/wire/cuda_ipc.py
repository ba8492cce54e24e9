"""Legacy CUDA IPC through the CUDA runtime that torch already loaded, called with ctypes.

Why not torch's own sharing (``storage._share_cuda_()``)? It ties the exported memory's lifetime to
reference counters in shared-memory files that importers decrement only when they free cleanly;
measured on the H200, the exporter still held its memory after earlier importers had exited. Here
the daemon allocates the arena with ``cudaMalloc``, exports one ``cudaIpcMemHandle_t`` (64 bytes,
sent base64-encoded inside the JSON reply), and frees it with ``cudaFree`` when the protocol says
so. Importers open the handle once, bind every tensor as a view, and close it when they stop.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

import torch

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


def malloc(size: int, device: torch.device) -> int:
    torch.cuda.set_device(device)
    _check(cudart().cudaSetDevice(device.index or 0), "cudaSetDevice")
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
    torch.cuda.set_device(device)
    _check(cudart().cudaSetDevice(device.index or 0), "cudaSetDevice")
    h = _Handle()
    ctypes.memmove(ctypes.addressof(h), handle, IPC_HANDLE_BYTES)
    ptr = ctypes.c_void_p()
    _check(cudart().cudaIpcOpenMemHandle(ctypes.byref(ptr), h, LAZY_ENABLE_PEER_ACCESS), "cudaIpcOpenMemHandle")
    return ptr.value


def close_handle(ptr: int) -> None:
    _check(cudart().cudaIpcCloseMemHandle(ctypes.c_void_p(ptr)), "cudaIpcCloseMemHandle")
