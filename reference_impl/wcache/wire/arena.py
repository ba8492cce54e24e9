"""How one rank's weights travel: packed into one arena, described by a JSON manifest.

Every transport shares the manifest format (``Layout``), the binding routine (``bind_views``) and
one interface, ``Arena``: the daemon ``pack``s a rank's weights into it (or ``adopt``s one a running
engine hands back, handback.py), sends its ``descriptor()`` and ``fds()`` with every get_state
reply, and ``close``s it. The engine side is ``arenas.open_arena``: a uint8 tensor over the daemon's
memory, and how to let go of it. ``ARENAS`` names each transport by its kind, the one name that
appears on the command line, in the loader's ``transport`` key, in descriptors and in logs:

* ``memfd`` (CPU, transports/memfd.py): a sealed memfd passed as a file descriptor;
* ``cuda_ipc`` (transports/cuda_ipc.py): one cudaMalloc block exported as a legacy CUDA IPC handle;
* ``vmm_fd`` (transports/cuda_vmm.py): a CUDA VMM allocation exported as a file descriptor.

Which kind a daemon serves for ``--weight-cache-transport auto`` is decided in one place,
transports/auto.py.
"""

from __future__ import annotations

import contextlib
import re
import uuid
from dataclasses import dataclass

import torch

from wcache.core.postprocess import ProcessedWeights
from wcache.wire.protocol import ProtocolError

PAGE = 4096
DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.bfloat16, torch.float16, torch.float32, torch.int8, torch.uint8, torch.int32, torch.int64,
    torch.float8_e4m3fn,  # FP8 weights (model/fp8.py): one byte each, bound as views like the others
)}
_GROUP_FIELDS = {"names", "dtype", "shape", "stride", "offset", "step"}


@dataclass
class Layout:
    """Where each tensor sits in the arena.

    Tensors that differ only by layer number (same dtype, shape and stride) are laid out back to
    back at a fixed step and form one *group*. The manifest then describes a group once, and the
    engine binds a whole group with one ``as_strided`` + ``unbind`` (the per-tensor work happens in
    C++), which is what makes a 10,000-tensor handoff cost milliseconds rather than tens of them.
    """

    groups: list[dict]  # names, dtype, shape, stride, offset (bytes), step (bytes)
    size: int  # arena bytes: a multiple of the page size (and, for vmm_fd, of the driver's granularity)

    @property
    def weights_bytes(self) -> int:
        return groups_bytes(self.groups)

    @classmethod
    def from_manifest(cls, manifest: dict, size: int) -> "Layout":
        """The layout a manifest describes; malformed ones raise ProtocolError (bind_views then
        checks that every view lies inside the arena)."""
        try:
            groups = manifest["groups"]
            for g in groups:
                if set(g) != _GROUP_FIELDS or g["dtype"] not in DTYPES \
                        or not all(isinstance(n, str) for n in g["names"]) \
                        or not all(isinstance(d, int) and d >= 0 for d in g["shape"]):
                    raise ProtocolError(f"bad manifest group {str(g)[:200]}")
        except (KeyError, TypeError) as e:
            raise ProtocolError(f"bad manifest: {str(e)[:200]}") from None
        return cls(groups, arena_size({"size": size}))

    @property
    def entries(self) -> list[dict]:
        """Per tensor: name, dtype, shape, stride, offset."""
        return [{"name": n, "dtype": g["dtype"], "shape": g["shape"], "stride": g["stride"],
                 "offset": g["offset"] + i * g["step"]} for g in self.groups for i, n in enumerate(g["names"])]


def groups_bytes(groups: list[dict]) -> int:
    """Bytes of every tensor the groups describe, a group at a time (no per-tensor work)."""
    return sum(len(g["names"]) * DTYPES[g["dtype"]].itemsize * _numel(g["shape"]) for g in groups)


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _group_key(name: str, t: torch.Tensor) -> tuple:
    return (re.sub(r"\.\d+\.", ".#.", name), t.dtype, tuple(t.shape), tuple(t.stride()))


def plan_layout(tensors: dict[str, torch.Tensor], align: int, granularity: int = PAGE) -> Layout:
    """Offsets for every tensor, each a multiple of ``align``; the size rounded up to ``granularity``."""
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
    return Layout(groups, max(granularity, -(-offset // granularity) * granularity))


def manifest(layout: Layout) -> dict:
    return {"groups": layout.groups}


def new_arena_id() -> str:
    """Names one packed arena for its whole life, across daemons that adopt it: an engine that
    handed its arena back knows by this id that a restarted daemon serves the same memory."""
    return uuid.uuid4().hex


def arena_size(desc: dict) -> int:
    size = desc.get("size")
    if not isinstance(size, int) or isinstance(size, bool) or size <= 0 or size % PAGE:
        raise ProtocolError(f"bad arena size {size!r}")
    return size


def bind_views(arena: torch.Tensor, manifest: dict) -> dict[str, torch.Tensor]:
    """Tensors for every manifest entry as views of ``arena`` (uint8).

    torch's own storage bounds check rejects any view that would reach outside the arena, so a
    malformed manifest fails here with a ProtocolError instead of reading foreign memory.
    """
    size = arena.numel()
    views: dict[str, torch.Tensor] = {}
    out: dict[str, torch.Tensor] = {}
    try:
        with _BELOW_VIEW_TRACKING():
            _bind_groups(arena, size, manifest["groups"], views, out)
    except ProtocolError:
        raise
    except (KeyError, TypeError, ValueError, RuntimeError, IndexError) as err:
        raise ProtocolError(f"bad manifest: {str(err)[:300]}") from None
    return out


# Views made below autograd's view tracking (ADInplaceOrView) are plain tensors over the same storage:
# no base, no shared version counter, a quarter cheaper each (measured: 10,005 views). Weights are
# never differentiated or written in place, so nothing uses what is skipped. torch's own guard where
# this torch has it; else the ordinary, tracked views.
_BELOW_VIEW_TRACKING = getattr(torch._C, "_AutoDispatchBelowADInplaceOrView", contextlib.nullcontext)


def _bind_groups(arena: torch.Tensor, size: int, groups, views: dict, out: dict) -> None:
    for g in groups:
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


class Arena:
    """The daemon's side: one rank's weights in memory that other processes can map.

    A transport subclasses it and implements ``pack`` (fill a new arena from processed weights),
    ``tensor`` (the daemon's own view), ``descriptor``/``fds`` (what a get_state reply carries),
    ``close`` and, on the engine's side,
    ``map`` (a MappedArena from a descriptor). ``adopt`` exists where a descriptor can be handed
    back to a restarted daemon (``handed_back``).
    """

    kind: str = ""
    handed_back = False  # whether a running engine can give this arena to a restarted daemon

    def __init__(self, layout: Layout, arena_id: str, weights_bytes: int):
        self.layout, self.id, self.weights_bytes = layout, arena_id, weights_bytes

    @property
    def size(self) -> int:
        """Bytes of memory the arena occupies: the same in the descriptor, in get_memory and after an
        adoption, because the layout's size is the allocation's."""
        return self.layout.size

    @classmethod
    def pack(cls, weights: ProcessedWeights, device: torch.device) -> "Arena":
        raise NotImplementedError

    @classmethod
    def adopt(cls, desc: dict, layout: Layout, fd: int, device: torch.device) -> "Arena":
        raise ProtocolError(f"a {cls.kind} arena cannot be handed back")

    @classmethod
    def map(cls, desc: dict, fds: list[int], device: torch.device) -> "MappedArena":
        raise NotImplementedError

    def tensor(self) -> torch.Tensor:
        """The whole arena as a uint8 tensor in this (the daemon's) process."""
        raise NotImplementedError

    def descriptor(self) -> dict:
        return {"kind": self.kind, "size": self.size, "id": self.id}

    def fds(self) -> list[int]:
        return []

    def close(self) -> None:
        raise NotImplementedError


class MappedArena:
    """The engine's side of an arena: a uint8 tensor over the daemon's memory, and how to let go."""

    def __init__(self, tensor: torch.Tensor, closer=None):
        self.tensor = tensor
        self._closer = closer

    def close(self) -> None:
        if self._closer is not None:
            self._closer()
            self._closer = None
