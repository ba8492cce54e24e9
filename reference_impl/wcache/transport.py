"""How one rank's weights travel: packed into one arena, described by a JSON manifest.

Daemon side: ``pack_cpu`` lays every tensor at an aligned offset of one memfd, writes the bytes,
then *seals* the memfd against writes, growth and shrinking. Engine side: ``open_cpu_arena`` maps
the received descriptor read-only, and ``bind_views`` turns the manifest into tensors that are
views of that mapping (zero-copy). Because of the seal, even an engine that tried to map the
memory writable would be refused by the kernel: no engine can corrupt the daemon's weights.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import warnings
from dataclasses import dataclass

import torch

from .postprocess import ProcessedWeights
from .protocol import ProtocolError

CPU_ALIGN = 64
PAGE = 4096
DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.bfloat16, torch.float16, torch.float32, torch.int8, torch.uint8, torch.int32, torch.int64,
)}


@dataclass
class Layout:
    entries: list[dict]  # name, dtype, shape, stride, offset (bytes)
    size: int  # arena bytes, a multiple of the page size


def plan_layout(tensors: dict[str, torch.Tensor], align: int) -> Layout:
    entries, offset = [], 0
    for name, t in tensors.items():
        offset = -(-offset // align) * align
        entries.append({"name": name, "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
                        "stride": list(t.stride()), "offset": offset})
        offset += t.numel() * t.element_size()
    return Layout(entries, max(PAGE, -(-offset // PAGE) * PAGE))


class CpuArena:
    """The daemon's sealed memfd holding one rank's weights."""

    kind = "memfd"

    def __init__(self, weights: ProcessedWeights):
        self.layout = plan_layout(weights.tensors, CPU_ALIGN)
        self.weights_bytes = weights.nbytes
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

    @property
    def size(self) -> int:
        return self.layout.size

    def descriptor(self) -> dict:
        return {"kind": self.kind, "size": self.layout.size}

    def fds(self) -> list[int]:
        return [self.fd]

    def close(self) -> None:
        if self.fd is not None:
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


def bind_views(arena: torch.Tensor, entries: list, aliases: dict) -> dict[str, torch.Tensor]:
    """Tensors for every manifest entry as views of ``arena`` (uint8), plus their aliases."""
    size = arena.numel()
    by_dtype: dict[torch.dtype, torch.Tensor] = {}
    out: dict[str, torch.Tensor] = {}
    for e in entries:
        try:
            name, dtype, shape, stride, offset = e["name"], DTYPES[e["dtype"]], e["shape"], e["stride"], e["offset"]
        except (KeyError, TypeError) as err:
            raise ProtocolError(f"bad manifest entry {str(e)[:200]}: {err!r}") from None
        item = dtype.itemsize
        extent = 1 + sum((s - 1) * st for s, st in zip(shape, stride)) if all(s > 0 for s in shape) else 0
        if (not isinstance(offset, int) or offset < 0 or offset % item
                or any(not isinstance(x, int) or x < 0 for x in (*shape, *stride))
                or offset + extent * item > size):
            raise ProtocolError(f"manifest entry {name!r} does not fit the {size}-byte arena")
        if dtype not in by_dtype:
            by_dtype[dtype] = arena[: size - size % item].view(dtype)
        out[name] = by_dtype[dtype].as_strided(shape, stride, offset // item)
    for alias, target in aliases.items():
        if target not in out:
            raise ProtocolError(f"alias {alias!r} points at unknown tensor {target!r}")
        out[alias] = out[target]
    return out
