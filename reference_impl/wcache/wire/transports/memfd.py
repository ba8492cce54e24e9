"""The CPU arena: one sealed memfd, passed to engines as a file descriptor.

The daemon lays every tensor at an aligned offset of the memfd, writes the bytes, then *seals* it
against writes, growth and shrinking. An engine maps the received descriptor read-only and binds
views of that mapping (zero-copy). Because of the seal, even an engine that tried to map the memory
writable would be refused by the kernel: no engine can corrupt the daemon's weights.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import warnings

import torch

from wcache.core.postprocess import ProcessedWeights
from wcache.wire.arena import Arena, Layout, MappedArena, arena_size, bind_views, manifest, new_arena_id, plan_layout
from wcache.wire.protocol import ProtocolError, close_fds

ALIGN = 64
SEALS = fcntl.F_SEAL_WRITE | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SHRINK


def _map_read_only(fd: int, size: int, populate: bool) -> mmap.mmap:
    flags = mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0) if populate else 0)
    return mmap.mmap(fd, size, flags=flags, prot=mmap.PROT_READ)


def _as_tensor(mm: mmap.mmap) -> torch.Tensor:
    with warnings.catch_warnings():
        # The mapping is read-only on purpose; torch warns that writes would be undefined.
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        return torch.frombuffer(mm, dtype=torch.uint8)


class MemfdArena(Arena):
    """The daemon's sealed memfd holding one rank's weights."""

    kind = "memfd"
    handed_back = True

    def __init__(self, layout: Layout, arena_id: str, weights_bytes: int, fd: int):
        super().__init__(layout, arena_id, weights_bytes)
        self.fd = fd
        # The daemon maps (and faults in) its own arena read-only: the pages then count as shared in
        # an engine's smaps, and the daemon's RSS shows the weights it holds.
        self.mapping = _map_read_only(fd, layout.size, populate=True)

    @classmethod
    def pack(cls, weights: ProcessedWeights, device: torch.device | None = None) -> "MemfdArena":
        layout = plan_layout(weights.tensors, ALIGN)
        fd = os.memfd_create("wcache-arena", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, layout.size)
            for e in layout.entries:
                t = weights.tensors[e["name"]].contiguous()
                view = memoryview(t.view(-1).view(torch.uint8).numpy())
                written = 0
                while written < len(view):
                    written += os.pwrite(fd, view[written:], e["offset"] + written)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS | fcntl.F_SEAL_SEAL)
            return cls(layout, new_arena_id(), weights.nbytes, fd)
        except BaseException:
            os.close(fd)
            raise

    @classmethod
    def adopt(cls, desc: dict, layout: Layout, fd: int, device: torch.device | None = None) -> "MemfdArena":
        """Serve a memfd an engine handed back instead of packing a new one.

        Only a memfd sealed against writes, growth and shrinking is taken: then its bytes are the
        ones the first daemon packed, whoever held it since. The descriptor is ours afterwards.
        """
        if fcntl.fcntl(fd, fcntl.F_GET_SEALS) & SEALS != SEALS:
            raise ProtocolError("the handed-back memfd is not sealed against writes, growth and shrinking")
        if os.fstat(fd).st_size != layout.size:
            raise ProtocolError(f"the handed-back memfd holds {os.fstat(fd).st_size} bytes, not {layout.size}")
        arena = cls(layout, desc["id"], layout.weights_bytes, fd)
        try:
            bind_views(arena.tensor(), manifest(layout))
        except ProtocolError:
            arena.mapping.close()
            raise
        return arena

    @classmethod
    def map(cls, desc: dict, fds: list[int], device: torch.device) -> MappedArena:
        """Map the daemon's memfd read-only as a uint8 tensor; the descriptor is closed afterwards."""
        if len(fds) != 1:
            close_fds(fds)
            raise ProtocolError(f"expected one memfd arena descriptor, got {len(fds)} fds")
        try:
            size = arena_size(desc)
            actual = os.fstat(fds[0]).st_size
            if size != actual:
                raise ProtocolError(f"arena size {size!r} does not match the descriptor's {actual}")
            mm = _map_read_only(fds[0], size, populate=False)
        finally:
            os.close(fds[0])
        return MappedArena(_as_tensor(mm))

    def tensor(self) -> torch.Tensor:
        return _as_tensor(self.mapping)

    def fds(self) -> list[int]:
        return [self.fd]

    def close(self) -> None:
        if self.fd is not None:
            self.mapping.close()
            os.close(self.fd)
            self.fd = None
