"""Where a replica receives seeded bytes, and how they become the arena it serves.

* ``memfd`` (CPU): the bytes are received straight into a new memfd through a writable shared
  mapping; once the digests check, the mapping is dropped and the memfd sealed exactly as
  ``MemfdArena.pack`` seals one. No copy besides the socket's own.
* any CUDA kind: the bytes are received into host memory (pinned), checked, and then packed by the
  transport's own ``pack`` (the host-to-device copy path every disk load takes), so a cuda_ipc or
  vmm_fd arena holds them exactly as it would hold a disk load's.

Nothing received is visible to an engine before ``finish``: the daemon binds its socket only after it.
"""

from __future__ import annotations

import fcntl
import gc
import mmap
import os

import torch

from wcache.core.postprocess import ProcessedWeights
from wcache.wire.arena import Arena, Layout, bind_views, new_arena_id
from wcache.wire.arenas import ARENAS
from wcache.wire.transports.memfd import SEALS, MemfdArena


class ReceiveTarget:
    """``buffer``: a writable flat uint8 CPU tensor of the arena's size that the bytes go into."""

    buffer: torch.Tensor

    def finish(self, layout: Layout, aliases: dict, attrs: dict, weights_bytes: int) -> Arena:
        raise NotImplementedError

    def abandon(self) -> None:
        raise NotImplementedError


class MemfdTarget(ReceiveTarget):
    def __init__(self, size: int):
        self.size = size
        self.fd = os.memfd_create("wcache-arena", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(self.fd, size)
            # Not populated: each page is allocated as the socket's copy first writes it, one pass
            # over the memory where populating first would zero it in a pass of its own.
            self.mapping = mmap.mmap(self.fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(self.fd)
            raise
        self.buffer = torch.frombuffer(self.mapping, dtype=torch.uint8)

    def _unmap(self) -> None:
        del self.buffer
        try:
            self.mapping.close()
        except BufferError:  # a view of the mapping made while receiving is still alive: collect it
            gc.collect()
            self.mapping.close()

    def finish(self, layout, aliases, attrs, weights_bytes) -> Arena:
        self._unmap()  # the write seal is refused while a writable mapping exists
        fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, SEALS | fcntl.F_SEAL_SEAL)
        fd, self.fd = self.fd, None
        return MemfdArena(layout, new_arena_id(), weights_bytes, fd)

    def abandon(self) -> None:
        if self.fd is not None:
            try:
                self._unmap()
            except (AttributeError, BufferError):
                pass
            os.close(self.fd)
            self.fd = None


class StagedTarget(ReceiveTarget):
    def __init__(self, size: int, kind: str, device: torch.device):
        self.kind, self.device = kind, device
        self.buffer = torch.empty(size, dtype=torch.uint8, pin_memory=torch.cuda.is_available())

    def finish(self, layout, aliases, attrs, weights_bytes) -> Arena:
        tensors = bind_views(self.buffer, {"groups": layout.groups})
        arena = ARENAS[self.kind].pack(ProcessedWeights(tensors, aliases, attrs), self.device)
        self.abandon()
        return arena

    def abandon(self) -> None:
        self.buffer = torch.empty(0, dtype=torch.uint8)


def make_target(kind: str, size: int, device: torch.device) -> ReceiveTarget:
    return MemfdTarget(size) if kind == "memfd" else StagedTarget(size, kind, device)
