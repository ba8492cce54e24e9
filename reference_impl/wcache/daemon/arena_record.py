"""What a daemon remembers of the arena it packed, so that a restarted daemon serves only that.

A hand-back offer (wire/handback.py) comes from an engine, and every process that reaches the
socket directory can plant one: a genuine arena it was served with a layout of its own, an arena
of the previous checkpoint, or memory of its own. So an offer's word counts for nothing. When a
daemon packs an arena it writes a *record* in its state directory (daemon/state_dir.py; engines
never share it), and a restarted daemon serves from an adopted arena only what the record says:

* what is served with the arena, bound to it: the manifest (layout), aliases, attributes, arena
  id, kind and size, and what it was packed for: the cache key (checkpoint digest, dtype, parallel
  rank, versions), the device, the rank and the socket. A restarted daemon adopts only if the
  record's key, device, rank, socket and transport are those it would pack now; the offer gives
  nothing but the descriptor;
* the arena's bytes, bound by what an engine cannot forge:
  - memfd: the inode (st_dev, st_ino), size and ctime. The kernel sets the ctime on every change,
    nobody can set it back, and the write seals forbid changes after packing: a memfd with this
    identity holds the bytes the daemon packed. Checking it is an fstat;
  - vmm_fd (GPU): a keyed hash of the bytes (daemon/arena_hash.py), computed on the GPU after
    packing and again before an adopted arena is served. Its secret key is in the record only.

Directory 0700, file 0600, written atomically and read relative to the checked directory's
descriptor with O_NOFOLLOW. A state directory that fails the checks disables hand-back, with the
reason logged.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import secrets
import stat
import time
from pathlib import Path

from wcache.daemon import arena_hash
from wcache.daemon.state_dir import UntrustedStateDir, default_path, open_dir
from wcache.errors import ARENA_NOT_RECORDED, ARENA_RECORD_UNSAFE, ARENA_RECORDED, ARENA_VERIFIED, RECORD_NOT_USABLE

log = logging.getLogger("wcache.daemon")

VERSION = 2
RECORDS = "arenas"
MAX_RECORD_BYTES = 256 << 20  # a manifest of 100,000 tensors is a few MiB


def state_dir() -> Path:
    return default_path()


def record_name(socket_path: Path) -> str:
    return hashlib.sha256(str(Path(socket_path).absolute()).encode()).hexdigest()[:24] + ".json"


def record_path(socket_path: Path) -> Path:
    return state_dir() / RECORDS / record_name(socket_path)


def _records_dir() -> int | None:
    """The checked records directory's descriptor, or None (hand-back disabled, reason logged)."""
    path = state_dir() / RECORDS
    try:
        return open_dir(path, create=True)
    except UntrustedStateDir as e:
        log.warning(ARENA_RECORD_UNSAFE.format(dir=path, why=e))
    except OSError as e:
        log.warning(ARENA_RECORD_UNSAFE.format(dir=path, why=e.strerror or e))
    return None


def _memfd_identity(fd: int) -> dict:
    st = os.fstat(fd)
    return {"dev": st.st_dev, "ino": st.st_ino, "size": st.st_size, "ctime_ns": st.st_ctime_ns}


def write(socket_path: Path, arena, served: dict, rank: int = 0) -> dict | None:
    """Record the arena this daemon packed and what it serves with it (``served``: key, device_id,
    manifest, aliases, attrs, weights_bytes); logs ARENA_RECORDED once a restarted daemon could
    adopt it."""
    t0 = time.perf_counter()
    rec = {"version": VERSION, "socket": str(Path(socket_path).absolute()), "rank": rank, "arena_id": arena.id,
           "kind": arena.kind, "size": arena.size, **served}
    if arena.kind == "memfd":
        rec["memfd"] = _memfd_identity(arena.fd)
    elif arena.kind == "vmm_fd":
        secret = arena_hash.new_secret()
        rec["hash"] = {"secret": secret, "digest": arena_hash.keyed_digest(arena.tensor(), secret)}
        rec["hash_seconds"] = round(time.perf_counter() - t0, 4)
    else:
        return None  # cuda_ipc is never handed back
    dfd = _records_dir()
    if dfd is None:
        return None
    name = record_name(socket_path)
    tmp = f".tmp-{secrets.token_hex(8)}"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dfd)
        with os.fdopen(fd, "w") as f:
            json.dump(rec, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
    except OSError as e:  # no record only means no adoption after a restart
        log.warning(ARENA_RECORD_UNSAFE.format(dir=state_dir() / RECORDS, why=e.strerror or e))
        try:
            os.unlink(tmp, dir_fd=dfd)
        except OSError:
            pass
        return None
    finally:
        os.close(dfd)
    log.info(ARENA_RECORDED.format(rank=rank, kind=arena.kind, seconds=time.perf_counter() - t0))
    return rec


def read(socket_path: Path) -> dict | None:
    """This socket's record, or None (none, or not trustworthy: logged)."""
    dfd = _records_dir()
    if dfd is None:
        return None
    where = state_dir() / RECORDS / record_name(socket_path)
    try:
        fd = os.open(record_name(socket_path), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
    except FileNotFoundError:
        return None
    except OSError as e:
        log.warning(ARENA_RECORD_UNSAFE.format(dir=where, why=e.strerror or e))
        return None
    finally:
        os.close(dfd)
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
            log.warning(ARENA_RECORD_UNSAFE.format(dir=where, why=f"the record is not a private file of this user "
                                                                  f"(mode {stat.S_IMODE(st.st_mode):o}, uid {st.st_uid})"))
            return None
        try:
            rec = json.loads(f.read(MAX_RECORD_BYTES))
        except ValueError:
            return None
    return rec if isinstance(rec, dict) and rec.get("version") == VERSION else None


class Record:
    """The record of the arena this daemon would pack now, if there is one; else ``usable`` is False.

    ``expect`` is what this daemon serves: its socket, rank, cache key, device and transport. The
    record is usable only if it was written for exactly those.
    """

    def __init__(self, socket_path: Path, rank: int, key: dict, device_id: str, kind: str):
        self.rank = rank
        rec = read(socket_path)
        why = None
        if rec is None:
            why = "this daemon has no record of an arena it packed"
        else:
            from wcache.core.fingerprint import mismatched_fields

            fields = mismatched_fields(key, rec.get("key") or {})
            if fields:
                why = f"its record is of an arena packed for other weights (cache key fields differ: {fields[:8]})"
            elif rec.get("device_id") != device_id or rec.get("rank") != rank:
                why = f"its record is of rank {rec.get('rank')} on {rec.get('device_id')}"
            elif rec.get("socket") != str(Path(socket_path).absolute()):
                why = "its record is of another socket"
            elif rec.get("kind") != kind:
                why = f"its record is of a {rec.get('kind')!r} arena, this rank serves {kind!r}"
        self.rec = rec if why is None else None
        self.why = why
        if why and rec is not None:
            log.info(RECORD_NOT_USABLE.format(rank=rank, why=why))

    @property
    def usable(self) -> bool:
        return self.rec is not None

    def descriptor(self) -> dict:
        return {"kind": self.rec["kind"], "size": self.rec["size"], "id": self.rec["arena_id"]}

    @property
    def served(self) -> tuple[dict, dict, dict]:
        """(manifest, aliases, attrs), as this daemon packed them."""
        return self.rec["manifest"], self.rec["aliases"], self.rec["attrs"]

    def verify(self, arena) -> None:
        """Raises ValueError unless ``arena`` holds the bytes this record was written for."""
        rec = self.rec
        if rec is None or rec["size"] != arena.size:
            raise ValueError(ARENA_NOT_RECORDED)
        if arena.kind == "memfd":
            if _memfd_identity(arena.fd) != rec.get("memfd"):
                raise ValueError(ARENA_NOT_RECORDED)
            return
        h = rec.get("hash") or {}
        t0 = time.perf_counter()
        digest = arena_hash.keyed_digest(arena.tensor(), h.get("secret", ""))
        seconds = time.perf_counter() - t0
        if digest != h.get("digest"):
            raise ValueError(f"{ARENA_NOT_RECORDED} (its bytes differ from those it packed)")
        log.info(ARENA_VERIFIED.format(rank=self.rank, mib=arena.size / 2**20, seconds=seconds))
