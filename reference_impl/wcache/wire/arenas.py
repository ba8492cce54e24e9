"""The table of arena kinds (``ARENAS``), and the calls that pick a transport by its kind.

Kept apart from arena.py: each transport module imports arena.py for the base classes, and this
module imports every transport, so no module imports one that imports it back.
"""

from __future__ import annotations

import torch

from wcache.core.postprocess import ProcessedWeights
from wcache.wire.arena import Arena, Layout, MappedArena
from wcache.wire.protocol import ProtocolError, close_fds
from wcache.wire.transports.auto import resolve_transport
from wcache.wire.transports.cuda_ipc import CudaIpcArena
from wcache.wire.transports.cuda_vmm import VmmFdArena
from wcache.wire.transports.memfd import MemfdArena

ARENAS: dict[str, type[Arena]] = {a.kind: a for a in (MemfdArena, CudaIpcArena, VmmFdArena)}
HANDED_BACK_KINDS = tuple(k for k, a in ARENAS.items() if a.handed_back)  # not cuda_ipc: its handle dies with its daemon


def open_arena(desc: dict, fds: list[int], device: torch.device) -> MappedArena:
    """Map the arena a get_state reply describes; any descriptor not handed on is closed."""
    cls = ARENAS.get(desc.get("kind"))
    if cls is None:
        close_fds(fds)
        raise ProtocolError(f"unknown arena kind {desc.get('kind')!r}")
    wanted = "cpu" if cls.kind == "memfd" else "cuda"
    if device.type != wanted:
        close_fds(fds)
        raise ProtocolError(f"the daemon serves a {cls.kind} arena but this engine runs on {device}")
    return cls.map(desc, fds, device)


def make_arena(weights: ProcessedWeights, device: torch.device, transport: str = "auto") -> Arena:
    """Pack a rank's weights into the arena the transport choice resolves to on this device."""
    return ARENAS[resolve_transport(transport, device)].pack(weights, device)


def adopt_arena(kind: str, desc: dict, layout: Layout, fd: int, device: torch.device) -> Arena:
    """Serve an arena a running engine handed back (handback.py) instead of packing a new one."""
    return ARENAS[kind].adopt(desc, layout, fd, device)
