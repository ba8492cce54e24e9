"""How one rank's weights travel: packed into one arena, described by a JSON manifest.

Two arenas share one manifest format and one binding routine: on CPU a sealed memfd passed as a
file descriptor, on CUDA one cudaMalloc'd block exported as a CUDA IPC handle (cuda_ipc.py).

Daemon side: ``pack_cpu`` lays every tensor at an aligned offset of one memfd, writes the bytes,
then *seals* the memfd against writes, growth and shrinking. Engine side: ``open_cpu_arena`` maps
the received descriptor read-only, and ``bind_views`` turns the manifest into tensors that are
views of that mapping (zero-copy). Because of the seal, even an engine that tried to map the
memory writable would be refused by the kernel: no engine can corrupt the daemon's weights.
"""

from __future__ import annotations

import base64
import fcntl
import mmap
import os
import re
import uuid
import warnings
from dataclasses import dataclass

import torch

from wcache.core.postprocess import ProcessedWeights
from wcache.wire.protocol import ProtocolError, close_fds

CPU_ALIGN = 64
CUDA_ALIGN = 512  # keeps every view aligned for vectorized kernels
PAGE = 4096
DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.bfloat16, torch.float16, torch.float32, torch.int8, torch.uint8, torch.int32, torch.int64,
)}


@dataclass
class Layout:
    """Where each tensor sits in the arena.

    Tensors that differ only by layer number (same dtype, shape and stride) are laid out back to
    back at a fixed step and form one *group*. The manifest then describes a group once, and the
    engine binds a whole group with one ``as_strided`` + ``unbind`` (the per-tensor work happens in
    C++), which is what makes a 10,000-tensor handoff cost milliseconds rather than tens of them.
    """

    groups: list[dict]  # names, dtype, shape, stride, offset (bytes), step (bytes)
    size: int  # arena bytes, a multiple of the page size

    @property
    def weights_bytes(self) -> int:
        return sum(len(g["names"]) * DTYPES[g["dtype"]].itemsize * _numel(g["shape"]) for g in self.groups)

    @classmethod
    def from_manifest(cls, manifest: dict, size: int) -> "Layout":
        """The layout a manifest describes; malformed ones raise ProtocolError (bind_views then
        checks that every view lies inside the arena)."""
        try:
            groups = manifest["groups"]
            for g in groups:
                if set(g) != {"names", "dtype", "shape", "stride", "offset", "step"} or g["dtype"] not in DTYPES \
                        or not all(isinstance(n, str) for n in g["names"]) \
                        or not all(isinstance(d, int) and d >= 0 for d in g["shape"]):
                    raise ProtocolError(f"bad manifest group {str(g)[:200]}")
        except (KeyError, TypeError) as e:
            raise ProtocolError(f"bad manifest: {str(e)[:200]}") from None
        if not isinstance(size, int) or isinstance(size, bool) or size <= 0 or size % PAGE:
            raise ProtocolError(f"bad arena size {size!r}")
        return cls(groups, size)

    @property
    def entries(self) -> list[dict]:
        """Per tensor: name, dtype, shape, stride, offset."""
        return [{"name": n, "dtype": g["dtype"], "shape": g["shape"], "stride": g["stride"],
                 "offset": g["offset"] + i * g["step"]} for g in self.groups for i, n in enumerate(g["names"])]


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def new_arena_id() -> str:
    """Names one packed arena for its whole life, across daemons that adopt it: an engine that
    handed its arena back knows by this id that a restarted daemon serves the same memory."""
    return uuid.uuid4().hex


def _group_key(name: str, t: torch.Tensor) -> tuple:
    return (re.sub(r"\.\d+\.", ".#.", name), t.dtype, tuple(t.shape), tuple(t.stride()))


def plan_layout(tensors: dict[str, torch.Tensor], align: int) -> Layout:
    grouped: dict[tuple, list[str]] = {}
    for name, t in tensors.items():
        grouped.setdefault(_group_key(name, t), []).append(name)
    groups, offset = [], 0
    for names in grouped.values():
        t = tensors[names[0]]
        nbytes = t.numel() * t.element_size()
        step = -(-nbytes // align) * align
        offset = -(-offset // align) * align
        groups.append({"names": names, "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
                       "stride": list(t.stride()), "offset": offset, "step": step})
        offset += step * (len(names) - 1) + nbytes
    return Layout(groups, max(PAGE, -(-offset // PAGE) * PAGE))


class CpuArena:
    """The daemon's sealed memfd holding one rank's weights."""

    kind = "memfd"

    def __init__(self, weights: ProcessedWeights):
        self.layout = plan_layout(weights.tensors, CPU_ALIGN)
        self.weights_bytes = weights.nbytes
        self.id = new_arena_id()
        self.fd = os.memfd_create("wcache-arena", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        os.ftruncate(self.fd, self.layout.size)
        for e in self.layout.entries:
            t = weights.tensors[e["name"]].contiguous()
            view = memoryview(t.view(-1).view(torch.uint8).numpy())
            written = 0
            while written < len(view):
                written += os.pwrite(self.fd, view[written:], e["offset"] + written)
        fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS,
                    fcntl.F_SEAL_WRITE | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_SEAL)
        # The daemon maps (and faults in) its own arena read-only: the pages then count as shared in
        # an engine's smaps, and the daemon's RSS shows the weights it holds.
        self.map = mmap.mmap(self.fd, self.layout.size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
                             prot=mmap.PROT_READ)

    @property
    def size(self) -> int:
        return self.layout.size

    @classmethod
    def adopt(cls, desc: dict, layout: "Layout", fd: int, device: torch.device | None = None) -> "CpuArena":
        """Serve a memfd an engine handed back (handback.py) instead of packing a new one.

        Only a memfd sealed against writes, growth and shrinking is taken: then its bytes are the
        ones the first daemon packed, whoever held it since. The descriptor is ours afterwards.
        """
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        needed = fcntl.F_SEAL_WRITE | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SHRINK
        if seals & needed != needed:
            raise ProtocolError("the handed-back memfd is not sealed against writes, growth and shrinking")
        if os.fstat(fd).st_size != layout.size:
            raise ProtocolError(f"the handed-back memfd holds {os.fstat(fd).st_size} bytes, not {layout.size}")
        self = cls.__new__(cls)
        self.layout, self.fd, self.id = layout, fd, desc["id"]
        self.map = mmap.mmap(fd, layout.size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
                             prot=mmap.PROT_READ)
        self.weights_bytes = layout.weights_bytes
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="The given buffer is not writable")
            bind_views(torch.frombuffer(self.map, dtype=torch.uint8), manifest(layout), {})
        return self

    def descriptor(self) -> dict:
        return {"kind": self.kind, "size": self.layout.size, "id": self.id}

    def fds(self) -> list[int]:
        return [self.fd]

    def close(self) -> None:
        if self.fd is not None:
            self.map.close()
            os.close(self.fd)
            self.fd = None


def open_cpu_arena(desc: dict, fds: list[int]) -> torch.Tensor:
    """Map the daemon's memfd read-only as a uint8 tensor; the descriptor is closed afterwards."""
    if desc.get("kind") != CpuArena.kind or len(fds) != 1:
        raise ProtocolError(f"expected one memfd arena descriptor, got {desc.get('kind')!r} with {len(fds)} fds")
    size = desc.get("size")
    try:
        actual = os.fstat(fds[0]).st_size
        if not isinstance(size, int) or size <= 0 or size != actual:
            raise ProtocolError(f"arena size {size!r} does not match the descriptor's {actual}")
        mm = mmap.mmap(fds[0], size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
    finally:
        os.close(fds[0])
    with warnings.catch_warnings():
        # The mapping is read-only on purpose; torch warns that writes would be undefined.
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        return torch.frombuffer(mm, dtype=torch.uint8)


def manifest(layout: Layout) -> dict:
    return {"groups": layout.groups}


def bind_views(arena: torch.Tensor, manifest: dict, aliases: dict) -> dict[str, torch.Tensor]:
    """Tensors for every manifest entry as views of ``arena`` (uint8), plus their aliases.

    torch's own storage bounds check rejects any view that would reach outside the arena, so a
    malformed manifest fails here with a ProtocolError instead of reading foreign memory.
    """
    size = arena.numel()
    views: dict[str, torch.Tensor] = {}
    out: dict[str, torch.Tensor] = {}
    try:
        for g in manifest["groups"]:
            names, dt, shape, stride, offset, step = (g["names"], g["dtype"], g["shape"], g["stride"],
                                                       g["offset"], g["step"])
            dtype = DTYPES[dt]
            item = dtype.itemsize
            if dt not in views:
                views[dt] = arena[: size - size % item].view(dtype)
            if not isinstance(offset, int) or not isinstance(step, int) or offset % item or step % item \
                    or offset < 0 or step < 0 or not names:
                raise ProtocolError(f"group {names[:1]} has a misaligned offset {offset!r} or step {step!r}")
            stacked = views[dt].as_strided([len(names), *shape], [step // item, *stride], offset // item)
            out.update(zip(names, stacked.unbind(0)))
    except ProtocolError:
        raise
    except (KeyError, TypeError, ValueError, RuntimeError, IndexError) as err:
        raise ProtocolError(f"bad manifest: {str(err)[:300]}") from None
    for alias, target in aliases.items():
        if target not in out:
            raise ProtocolError(f"alias {alias!r} points at unknown tensor {target!r}")
        out[alias] = out[target]
    return out


def _fill_device_arena(arena: torch.Tensor, layout: Layout, weights: ProcessedWeights) -> None:
    for e in layout.entries:
        t = weights.tensors[e["name"]].contiguous().view(-1).view(torch.uint8)
        arena[e["offset"] : e["offset"] + t.numel()].copy_(t)
    torch.cuda.synchronize(arena.device)


class CudaArena:
    """The daemon's device arena: one cudaMalloc, exported once as a CUDA IPC handle."""

    kind = "cuda_ipc"

    def __init__(self, weights: ProcessedWeights, device: torch.device):
        from wcache.wire import cuda_ipc

        self.layout = plan_layout(weights.tensors, CUDA_ALIGN)
        self.weights_bytes = weights.nbytes
        self.device = device
        self.ptr = cuda_ipc.malloc(self.layout.size, device)
        _fill_device_arena(cuda_ipc.as_tensor(self.ptr, self.layout.size, device), self.layout, weights)
        self.handle = cuda_ipc.export_handle(self.ptr)
        self.id = new_arena_id()

    @property
    def size(self) -> int:
        return self.layout.size

    def descriptor(self) -> dict:
        return {"kind": self.kind, "size": self.layout.size, "handle": base64.b64encode(self.handle).decode(),
                "id": self.id}

    def fds(self) -> list[int]:
        return []

    def close(self) -> None:
        if self.ptr is not None:
            from wcache.wire import cuda_ipc

            torch.cuda.synchronize(self.device)
            cuda_ipc.free(self.ptr)
            self.ptr = None


class CudaVmmArena:
    """The daemon's device arena as a CUDA VMM allocation, exported once as a file descriptor."""

    kind = "cuda_vmm_fd"

    def __init__(self, weights: ProcessedWeights, device: torch.device):
        from wcache.wire import cuda_vmm

        self.layout = plan_layout(weights.tensors, CUDA_ALIGN)
        self.weights_bytes = weights.nbytes
        self.device = device
        self.alloc = cuda_vmm.create(self.layout.size, device)
        _fill_device_arena(self.alloc.tensor(device), self.layout, weights)
        self.fd = cuda_vmm.export_fd(self.alloc)
        self.id = new_arena_id()

    @classmethod
    def adopt(cls, desc: dict, layout: "Layout", fd: int, device: torch.device) -> "CudaVmmArena":
        """Serve a VMM allocation an engine handed back: import it (our own reference, so the memory
        lives while this daemon does) and pass the same descriptor on to later engines."""
        from wcache.wire import cuda_vmm

        alloc = cuda_vmm.import_fd(os.dup(fd), layout.size, device)
        try:
            bind_views(alloc.tensor(device), manifest(layout), {})
        except ProtocolError:
            alloc.close()
            raise
        self = cls.__new__(cls)
        self.layout, self.alloc, self.fd, self.device, self.id = layout, alloc, fd, device, desc["id"]
        self.weights_bytes = layout.weights_bytes
        return self

    @property
    def size(self) -> int:
        return self.layout.size

    def descriptor(self) -> dict:
        return {"kind": self.kind, "size": self.alloc.size, "id": self.id}

    def fds(self) -> list[int]:
        return [self.fd]

    def close(self) -> None:
        # Drops the daemon's reference; the memory returns once every importer has released it too.
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
            self.alloc.close()


TRANSPORTS = ("auto", "cuda_ipc", "vmm_fd")


def resolve_transport(choice: str, device: torch.device) -> str:
    """The arena kind a daemon serves: memfd on CPU; on CUDA vmm_fd when the driver bindings are
    installed (``auto``), else legacy CUDA IPC."""
    if device.type != "cuda":
        return CpuArena.kind
    if choice == "auto":
        from wcache.wire import cuda_vmm

        return CudaVmmArena.kind if cuda_vmm.available() else CudaArena.kind
    return {"cuda_ipc": CudaArena.kind, "vmm_fd": CudaVmmArena.kind}[choice]


def make_arena(weights: ProcessedWeights, device: torch.device, transport: str = "auto"):
    kind = resolve_transport(transport, device)
    return {CpuArena.kind: lambda: CpuArena(weights), CudaArena.kind: lambda: CudaArena(weights, device),
            CudaVmmArena.kind: lambda: CudaVmmArena(weights, device)}[kind]()


def adopt_arena(kind: str, desc: dict, layout: Layout, fd: int, device: torch.device):
    """Serve an arena a running engine handed back (handback.py) instead of packing a new one."""
    return {CpuArena.kind: CpuArena, CudaVmmArena.kind: CudaVmmArena}[kind].adopt(desc, layout, fd, device)


class MappedArena:
    """The engine's side of an arena: a uint8 tensor over the daemon's memory, and how to let go."""

    def __init__(self, tensor: torch.Tensor, closer=None):
        self.tensor = tensor
        self._closer = closer

    def close(self) -> None:
        if self._closer is not None:
            self._closer()
            self._closer = None


def _arena_size(desc: dict) -> int:
    size = desc.get("size")
    if not isinstance(size, int) or isinstance(size, bool) or size <= 0:
        raise ProtocolError(f"bad arena size {size!r}")
    return size


def open_arena(desc: dict, fds: list[int], device: torch.device) -> MappedArena:
    """Map the arena a get_state reply describes; any descriptor not handed on is closed."""
    kind = desc.get("kind")
    if kind == CpuArena.kind:
        if device.type != "cpu":
            close_fds(fds)
            raise ProtocolError(f"the daemon serves a CPU arena but this engine runs on {device}")
        return MappedArena(open_cpu_arena(desc, fds))
    if kind == CudaVmmArena.kind:
        try:
            if device.type != "cuda" or len(fds) != 1:
                raise ProtocolError(f"expected one CUDA VMM descriptor for a {device} engine, got {len(fds)}")
            size = _arena_size(desc)
        except ProtocolError:
            close_fds(fds)
            raise
        from wcache.wire import cuda_vmm

        alloc = cuda_vmm.import_fd(fds[0], size, device)
        return MappedArena(alloc.tensor(device), alloc.close)
    close_fds(fds)
    if kind == CudaArena.kind:
        if device.type != "cuda":
            raise ProtocolError(f"the daemon serves a CUDA arena but this engine runs on {device}")
        from wcache.wire import cuda_ipc

        try:
            handle = base64.b64decode(desc.get("handle", ""), validate=True)
        except (ValueError, TypeError) as e:
            raise ProtocolError(f"bad CUDA IPC handle: {e}") from None
        size = _arena_size(desc)
        ptr = cuda_ipc.open_handle(handle, device)
        return MappedArena(cuda_ipc.as_tensor(ptr, size, device), lambda: cuda_ipc.close_handle(ptr))
    raise ProtocolError(f"unknown arena kind {kind!r}")
