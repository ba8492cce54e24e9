"""The cache key: everything that must be equal for a daemon's weights to be this engine's weights.

Upstream hashes the safetensors file names and JSON headers only, so a checkpoint whose tensor
*values* changed with the same shapes (a zeroed norm, one flipped byte) was served silently. Here
the checkpoint field is a digest of every byte of every shard (names without directories, so the
same weights in another directory still match). Hashing is one pass over the files; to keep a
restart cheap, each file's digest is remembered under the cache root together with the file's
identity (device, inode, size, mtime and ctime in nanoseconds), and reused only while the file's
identity is unchanged.

That is sound only for bytes that no write can change without changing the identity, and not every
write does: a write(2) sets mtime and ctime, but a write through a shared mapping sets them only in
the page fault that makes a clean page writable. Once a page is dirty, further writes through the
same mapping change the bytes and no time at all (tested in tests/unit/test_fingerprint.py). So a
digest is remembered only when every condition below holds, each for a reason:

* The file's dirty pages were written back (fsync) before it was hashed. Writeback write-protects
  every mapping of a cleaned page, so the next write through any mapping faults again and sets
  mtime and ctime, which nobody can set back to an earlier ctime. fsync works on a read-only
  descriptor on Linux; where it fails (EROFS, EINVAL: a filesystem that cannot write back), the
  digest serves this start only.
* The filesystem writes pages back at all. tmpfs, ramfs and hugetlbfs keep pages in memory with no
  writeback, so fsync cleans nothing and a dirty page stays writable without a fault forever:
  checkpoints there are hashed on every start (MEMORY_FILESYSTEMS).
* The identity did not change while the file was hashed (fstat before and after): a write during
  the pass would leave a digest of neither version.
* The file's mtime and ctime are older than RACY_WINDOW_NS before hashing began, as git treats a
  racy index entry: timestamps can be coarse (a jiffy on older kernels, a second on some
  filesystems), so a write in the same tick as the hashed one could leave the same times. A write
  after the pass gets a time later than the pass began, which a settled file's times are not.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from wcache import PROTOCOL_VERSION, __version__
from wcache.core import checkpoint_files, seeded_checkpoint
from wcache.core.config import EngineConfig
from wcache.core.device import device_arch

KEY_FIELDS = (
    "checkpoint", "architecture", "tp_size", "tp_rank", "pp_size", "pp_rank", "dp_size", "dp_rank",
    "dtype", "quantization", "quantization_config", "revision", "version", "protocol_version",
    "device_kind", "device_arch",
)
CHUNK = 16 << 20
RACY_WINDOW_NS = 2_000_000_000


def cache_root() -> Path:
    return Path(os.environ.get("WCACHE_CACHE_ROOT") or Path.home() / ".cache" / "wcache")


def _file_identity(st: os.stat_result) -> list[int]:
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


# Filesystems that never write pages back: a dirty page of a shared mapping stays writable
# without another fault, so no write through it would ever change the file's times.
MEMORY_FILESYSTEMS = frozenset({"tmpfs", "ramfs", "hugetlbfs", "devtmpfs"})


def _filesystem_type(st: os.stat_result) -> str | None:
    """The type of the mounted filesystem that holds a file (by its device in /proc/self/mountinfo)."""
    dev = f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}"
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        fields, _, rest = line.partition(" - ")
        if fields.split()[2:3] == [dev]:
            return rest.split()[0]
    return None


def _hash_file(path: Path) -> tuple[str, os.stat_result | None]:
    """The file's SHA-256, and its identity if the digest may be remembered (see the module's
    docstring): written back first, unchanged while hashed, on a filesystem that writes back."""
    h = hashlib.sha256()  # SHA-NI makes it the fastest cryptographic hash here
    try:
        f = open(path, "rb", buffering=0)
    except OSError as e:
        raise checkpoint_files.CheckpointError(f"Cannot read checkpoint file {path}: {e.strerror}") from None
    with f:
        try:
            os.fsync(f.fileno())  # dirty pages to disk, their mappings write-protected again
            written_back = True
        except OSError:  # EROFS, EINVAL: nothing proves the bytes clean; this start only
            written_back = False
        before = os.fstat(f.fileno())
        buf = bytearray(CHUNK)
        view = memoryview(buf)
        while n := f.readinto(buf):
            h.update(view[:n])  # releases the GIL: files hash in parallel threads
        after = os.fstat(f.fileno())
    clean = (written_back and _file_identity(before) == _file_identity(after)
             and _filesystem_type(after) not in MEMORY_FILESYSTEMS | {None})
    return h.hexdigest(), after if clean else None


def _remembered(entry, st: os.stat_result) -> bool:
    """Whether a remembered digest holds for the file now. Entries of versions that did not write
    a file back before hashing it (no "written_back") are hashed again."""
    return isinstance(entry, dict) and entry.get("written_back") is True and entry.get("identity") == _file_identity(st)


def _memo_path(model_dir: Path) -> Path:
    # os.path.realpath is what Path.resolve() runs, without building Paths (on a restarted engine's
    # way to its weights, every tenth of a millisecond shows).
    tag = hashlib.sha256(os.path.realpath(model_dir).encode()).hexdigest()[:24]
    return cache_root() / "fingerprints" / f"{tag}.json"


def checkpoint_digest(model_dir: str | os.PathLike, rehash: bool = False,
                      entries: dict | None = None) -> tuple[str, dict]:
    """Digest over (file name, size, content hash) of every shard, plus stats of how it was made.
    ``rehash``: hash every file, remembered or not (--weight-cache-rehash). ``entries``: filled with
    each file's [size, sha256] (what a seed daemon sends its replicas)."""
    model_dir = Path(model_dir)
    seeded = seeded_checkpoint.digest(model_dir, cache_root(), combine)
    if seeded is not None:  # a replica whose weights came from a seed daemon: no shard to hash
        digest, stats, files = seeded
        if entries is not None:
            entries.update(files)
        return digest, stats
    files = checkpoint_files.shard_files(model_dir, whole=False) + [model_dir / "config.json"]
    memo_file = _memo_path(model_dir)
    try:
        memo = json.loads(memo_file.read_text())
    except (OSError, ValueError):
        memo = {}
    started = time.time_ns()
    stats = {p.name: os.stat(p) for p in files}
    fresh = {n for n, st in stats.items() if rehash or not _remembered(memo.get(n), st)}
    hashed = {}
    if fresh:
        with ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1)) as pool:
            hashed = dict(zip(sorted(fresh), pool.map(_hash_file, [model_dir / n for n in sorted(fresh)])))
    settled = {n for n, st in stats.items() if n not in fresh}  # remembered, and still untouched
    for n, (digest, clean) in hashed.items():
        stats[n] = clean or stats[n]  # the identity the digest is valid for, when there is one
        memo[n] = {"identity": _file_identity(stats[n]), "sha256": digest, "written_back": True}
        if clean is not None and max(clean.st_mtime_ns, clean.st_ctime_ns) < started - RACY_WINDOW_NS:
            settled.add(n)
    if fresh:
        _atomic_write_json(memo_file, {n: memo[n] for n in stats if n in settled})
    files = {n: [stats[n].st_size, memo[n]["sha256"]] for n in stats}
    if entries is not None:
        entries.update(files)
    hashed_bytes = sum(stats[n].st_size for n in fresh)
    return combine(files), {"files": len(stats), "files_hashed": len(fresh), "bytes_hashed": hashed_bytes,
                            "files_unsettled": len(stats) - len(settled)}


def combine(entries: dict[str, list]) -> str:
    """The checkpoint digest from each file's [size, sha256]: what a seeded replica, which has the
    source's list but no shard, computes the same way."""
    h = hashlib.sha256()
    for n in sorted(entries):
        h.update(f"{n}\0{entries[n][0]}\0{entries[n][1]}\n".encode())
    return h.hexdigest()


def _atomic_write_json(path: Path, obj) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
        with os.fdopen(fd, "w") as f:
            json.dump(obj, f)
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only cache root only costs the next start a re-hash


def cache_key(cfg: EngineConfig, digest: str | None = None) -> dict:
    r = cfg.ranks
    return {
        "checkpoint": digest or checkpoint_digest(cfg.model)[0],
        "architecture": ",".join(cfg.hf.get("architectures", [])) or cfg.hf.get("model_type", ""),
        "tp_size": r.tp_size, "tp_rank": r.tp_rank,
        "pp_size": r.pp_size, "pp_rank": r.pp_rank,
        "dp_size": r.dp_size, "dp_rank": r.dp_rank,
        "dtype": cfg.dtype_name,
        "quantization": cfg.quant.name,
        "quantization_config": cfg.quant.config_hash(),
        "revision": cfg.revision,
        "version": __version__,
        "protocol_version": PROTOCOL_VERSION,
        "device_kind": cfg.device,
        "device_arch": device_arch(cfg.device, r.local_rank),
    }


def mismatched_fields(daemon_key: dict, engine_key: dict) -> list[str]:
    names = sorted(set(daemon_key) | set(engine_key))
    return [n for n in names if daemon_key.get(n) != engine_key.get(n)]
