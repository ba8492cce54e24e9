"""Where a replica receives seeded bytes, and how they become the arena it serves.

* ``memfd`` (CPU): the bytes are received a piece at a time into a small buffer that stays in the
  cache and written into a new memfd with pwrite(2); once the digests check, the memfd is sealed
  exactly as ``MemfdArena.pack`` seals one. Why not receive straight into a shared mapping of the
  memfd (one copy fewer): each of its 4 KiB pages then costs a page fault that allocates and zeroes
  it, and dropping the mapping before the seal walks them all again; a write(2) into a memfd
  allocates its pages with no fault. Compared on the 2-core CPU host, the small model's arena over
  loopback into each (repeated, in turn): the buffer and pwrite were the faster; the seed's rate
  against a plain copy into fresh memory is what `wcache bench --seed` records.
* any CUDA kind: the bytes are received into host memory (pinned), checked, and then packed by the
  transport's own ``pack`` (the host-to-device copy path every disk load takes), so a cuda_ipc or
  vmm_fd arena holds them exactly as it would hold a disk load's.

Nothing received is visible to an engine before ``finish``: the daemon binds its socket only after it.
"""

from __future__ import annotations

import fcntl
import os

import torch

from wcache.core.postprocess import ProcessedWeights
from wcache.wire.arena import Arena, Layout, bind_views, new_arena_id
from wcache.wire.arenas import ARENAS
from wcache.wire.transports.memfd import SEALS, MemfdArena


class ReceiveTarget:
    """Where the arena's bytes land: ``into(offset, n)`` is the writable memory the bytes
    [offset, offset + n) are to be received into, and ``landed`` is told once they are there.
    ``written``: bytes the target itself wrote with write-family calls (not sent anywhere)."""

    written = 0

    buffer: torch.Tensor | None  # the whole arena as a flat uint8 tensor, where the target holds one

    def into(self, offset: int, n: int) -> memoryview:
        raise NotImplementedError

    def landed(self, offset: int, view: memoryview) -> None:
        raise NotImplementedError

    def finish(self, layout: Layout, aliases: dict, attrs: dict, weights_bytes: int) -> Arena:
        raise NotImplementedError

    def abandon(self) -> None:
        raise NotImplementedError


class MemfdTarget(ReceiveTarget):
    buffer = None

    def __init__(self, size: int):
        self.size = size
        self.fd = os.memfd_create("wcache-arena", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(self.fd, size)
        except BaseException:
            os.close(self.fd)
            raise
        self.landing = bytearray(0)
        self.written = 0  # pwrite(2) counts in /proc/self/io's wchar, which stands for bytes sent

    def into(self, offset: int, n: int) -> memoryview:
        if len(self.landing) < n:  # once per size asked: the stream's step, a round's chunk
            self.landing = bytearray(n)
        return memoryview(self.landing)[:n]

    def landed(self, offset: int, view: memoryview) -> None:
        done = 0
        while done < len(view):
            done += os.pwrite(self.fd, view[done:], offset + done)
        self.written += done

    def finish(self, layout, aliases, attrs, weights_bytes) -> Arena:
        self.landing = bytearray(0)
        fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, SEALS | fcntl.F_SEAL_SEAL)
        fd, self.fd = self.fd, None
        return MemfdArena(layout, new_arena_id(), weights_bytes, fd)

    def abandon(self) -> None:
        self.landing = bytearray(0)
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


class StagedTarget(ReceiveTarget):
    def __init__(self, size: int, kind: str, device: torch.device):
        self.kind, self.device = kind, device
        self.buffer = torch.empty(size, dtype=torch.uint8, pin_memory=torch.cuda.is_available())

    def into(self, offset: int, n: int) -> memoryview:  # straight into the staging buffer: no copy
        return memoryview(self.buffer[offset:offset + n].numpy())

    def landed(self, offset: int, view: memoryview) -> None:
        pass

    def finish(self, layout, aliases, attrs, weights_bytes) -> Arena:
        tensors = bind_views(self.buffer, {"groups": layout.groups})
        arena = ARENAS[self.kind].pack(ProcessedWeights(tensors, aliases, attrs), self.device)
        self.abandon()
        return arena

    def abandon(self) -> None:
        self.buffer = torch.empty(0, dtype=torch.uint8)


def make_target(kind: str, size: int, device: torch.device) -> ReceiveTarget:
    return MemfdTarget(size) if kind == "memfd" else StagedTarget(size, kind, device)
