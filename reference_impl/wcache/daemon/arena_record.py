"""What a daemon remembers of the arena it packed, so that a restarted daemon adopts only that arena.

A hand-back offer (wire/handback.py) comes from an engine, and every engine container of the
daemon's uid can plant one: its own sealed memfd with the right cache key and altered weights. So
the offer's word is not enough. When a daemon packs an arena it records, in a file only the daemon
can reach, what an engine cannot forge about it:

* memfd: the inode (st_dev, st_ino), size and ctime of the memfd. The kernel sets the ctime on
  every change, nobody can set it back, and the write seals forbid changes after packing: a memfd
  with this identity holds the bytes the daemon packed. Checking it is an fstat, no hashing.
* vmm_fd (GPU): a SHA-256 of the arena's bytes, computed once after packing, in the background
  while the daemon already serves (a daemon killed before it finishes leaves no record: the next
  one loads from disk). VMM memory cannot be sealed and every engine maps it writable, so an
  adopting daemon hashes the memory again (chunked device-to-host copies) and serves it only if the
  digest matches.

The record lives under the daemon's state directory (``$WCACHE_STATE_DIR``, else
``$XDG_STATE_HOME/wcache``, else ``~/.local/state/wcache``), never in the socket directory that
engine containers share: directory 0700, file 0600, written atomically. A directory that is not
ours, or that others can write, is not trusted (nothing is adopted).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import stat
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from wcache.errors import ARENA_NOT_RECORDED, ARENA_RECORD_UNSAFE, ARENA_RECORDED, ARENA_VERIFIED

log = logging.getLogger("wcache.daemon")

CHUNK = 16 << 20  # bytes hashed per step (one device-to-host copy on a GPU, into a pinned buffer per thread)


def state_dir() -> Path:
    explicit = os.environ.get("WCACHE_STATE_DIR")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state"
    return Path(base) / "wcache"


def record_path(socket_path: Path) -> Path:
    tag = hashlib.sha256(str(Path(socket_path).absolute()).encode()).hexdigest()[:24]
    return state_dir() / "arenas" / f"{tag}.json"


def arena_digest(arena: torch.Tensor, chunk: int = CHUNK, workers: int | None = None) -> str:
    """SHA-256 over the SHA-256 of each ``chunk`` of a flat uint8 tensor, on the CPU or a GPU.

    Chunks are hashed on ``workers`` threads at once (hashlib lets go of the GIL), each with its
    own pinned host buffer for a GPU's chunks: one SHA-256 stream runs at about 1.5 GB/s, too slow
    for a GPU arena of tens of GiB.
    """
    flat = arena.reshape(-1).view(torch.uint8)
    starts = range(0, flat.numel(), chunk)
    workers = max(1, min(workers or os.cpu_count() or 1, 16, len(starts) or 1))
    local = threading.local()

    def one(start: int) -> bytes:
        part = flat[start : start + chunk]
        if part.device.type != "cpu":
            if getattr(local, "staging", None) is None:
                local.staging = torch.empty(min(chunk, flat.numel()), dtype=torch.uint8, pin_memory=True)
            host = local.staging[: part.numel()]
            host.copy_(part)  # synchronous: the bytes are on the host when it returns
            part = host
        return hashlib.sha256(memoryview(part.numpy())).digest()

    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="wcache-hash") as pool:
        digests = list(pool.map(one, starts))
    return hashlib.sha256(b"".join(digests)).hexdigest()


def _memfd_identity(fd: int) -> dict:
    st = os.fstat(fd)
    return {"dev": st.st_dev, "ino": st.st_ino, "size": st.st_size, "ctime_ns": st.st_ctime_ns}


def _trusted_dir(d: Path) -> bool:
    st = os.lstat(d)
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and not st.st_mode & 0o022


def write(socket_path: Path, arena, rank: int = 0) -> dict | None:
    """Record the arena this daemon packed (memfd identity, or the digest of a GPU arena); logs
    ARENA_RECORDED once a restarted daemon could adopt it."""
    t0 = time.perf_counter()
    rec = {"arena_id": arena.id, "kind": arena.kind, "size": arena.size}
    if arena.kind == "memfd":
        rec["memfd"] = _memfd_identity(arena.fd)
    elif arena.kind == "vmm_fd":
        t0 = time.perf_counter()
        rec["sha256"] = arena_digest(arena.tensor())
        rec["hash_seconds"] = round(time.perf_counter() - t0, 4)
    else:
        return None  # cuda_ipc is never handed back
    path = record_path(socket_path)
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        if not _trusted_dir(path.parent):
            log.warning(ARENA_RECORD_UNSAFE.format(dir=path.parent))
            return None
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")  # mode 0600
        with os.fdopen(fd, "w") as f:
            json.dump(rec, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:  # no record only means no adoption after a restart
        log.warning(ARENA_RECORD_UNSAFE.format(dir=f"{path.parent} ({e})"))
        return None
    log.info(ARENA_RECORDED.format(rank=rank, kind=arena.kind, seconds=time.perf_counter() - t0))
    return rec


def read(socket_path: Path) -> dict | None:
    path = record_path(socket_path)
    try:
        if not _trusted_dir(path.parent):
            log.warning(ARENA_RECORD_UNSAFE.format(dir=path.parent))
            return None
        st = os.lstat(path)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
            log.warning(ARENA_RECORD_UNSAFE.format(dir=path))
            return None
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


class Verifier:
    """Called by take_back with each adopted arena; raises ValueError unless it is the recorded one."""

    def __init__(self, socket_path: Path, rank: int):
        self.record = read(socket_path)
        self.rank = rank

    def __call__(self, arena) -> None:
        rec = self.record
        if not rec or rec.get("arena_id") != arena.id or rec.get("kind") != arena.kind:
            raise ValueError(ARENA_NOT_RECORDED)
        if arena.kind == "memfd":
            if _memfd_identity(arena.fd) != rec.get("memfd"):
                raise ValueError(ARENA_NOT_RECORDED)
            return
        t0 = time.perf_counter()
        digest = arena_digest(arena.tensor())
        seconds = time.perf_counter() - t0
        if digest != rec.get("sha256"):
            raise ValueError(f"{ARENA_NOT_RECORDED} (its bytes changed since it was packed)")
        log.info(ARENA_VERIFIED.format(rank=self.rank, mib=arena.size / 2**20, seconds=seconds))
