"""A write through a shared mapping's dirty page never slips past the remembered checkpoint hashes.

The attack: a process of the user maps a shard MAP_SHARED and writes one byte, so the page is
dirty and stays writable. The daemon hashes the checkpoint and remembers the digest by the file's
identity. Then the process zeroes the final norm through the same dirty page of the same mapping:
without the daemon's fsync before hashing, that write changes neither mtime nor ctime, the restarted
daemon reuses the old digest and serves the old weights under the new checkpoint's key. With it,
the write faults again and the times change: an engine started beside the old daemon computes the
new key and is refused, and the restarted daemon hashes the shard again and does not adopt the old
arena that a running engine offers: new engines answer exactly as a disk load of the changed
checkpoint does.
"""

from __future__ import annotations

import json
import mmap
import os
import re
import shutil
import struct
import time

from procs import complete
from wcache.core import fingerprint

NO_TUNE = "--no-enable-autotune"
PROMPT = "dirty pages"


def norm_span(shard) -> tuple[int, int]:
    """File offsets [start, end) of model.norm.weight's bytes in a safetensors shard."""
    with open(shard, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        start, end = json.loads(f.read(header_len))["model.norm.weight"]["data_offsets"]
    return 8 + header_len + start, 8 + header_len + end


def norm_shard(model):
    for shard in sorted(model.glob("*.safetensors")):
        with open(shard, "rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            if "model.norm.weight" in json.loads(f.read(header_len)):
                return shard
    raise AssertionError("no shard holds model.norm.weight")


def tokens(engine) -> list:
    answer = complete(engine.port, PROMPT, max_tokens=8)
    return [c["text"] for c in answer["choices"]]


def test_a_write_through_a_dirty_page_is_seen_by_a_restarted_daemon(procs, tiny_model, tmp_path):
    model = shutil.copytree(tiny_model, tmp_path / "model")
    shard = norm_shard(model)
    start, end = norm_span(shard)
    fd = os.open(shard, os.O_RDWR)
    mapping = mmap.mmap(fd, 0, mmap.MAP_SHARED)
    try:
        mapping[start] = mapping[start]  # the same value: the page is dirty, the weights unchanged
        # Past the racy window, so that the daemon remembers the shard's digest.
        time.sleep(fingerprint.RACY_WINDOW_NS / 1e9 + 0.2)
        first = procs.preload(model, NO_TUNE)
        assert re.search(r"hashed 3 of 3 files", first.log()), first.log()
        # A zero_copy engine that keeps running: across the restart it offers the arena it maps.
        before = tokens(procs.serve(model, "--load-format", "ipc_cache", NO_TUNE))

        # The premise: the bytes change through the same mapping, no munmap, no write(2).
        identity = os.stat(shard)
        mapping[start:end] = bytes(end - start)
        after = os.stat(shard)
        # An engine started now, against the daemon that still holds the old weights, computes
        # the new key: it is refused and loads from disk.
        beside = procs.serve(model, "--load-format", "ipc_cache", NO_TUNE)
        assert "WeightCacheKey mismatch on fields: ['checkpoint']" in beside.log()
        assert first.stop() == 0

        second = procs.preload(model, NO_TUNE)
        cached = tokens(procs.serve(model, "--load-format", "ipc_cache", NO_TUNE))
        disk = tokens(procs.serve(model, "--load-format", "safetensors", NO_TUNE))
    finally:
        mapping.close()
        os.close(fd)
    assert disk != before, "zeroing the norm should change the answer"
    assert tokens(beside) == disk
    assert cached == disk, f"the restarted daemon served the old weights:\n{second.log()}"
    # The old arena, offered by the first engine, is refused: the daemon's own record of it is of the
    # old checkpoint's key (daemon/arena_record.py), so no offer is even asked.
    assert ("adopts no handed-back arena: its record is of an arena packed for other weights "
            "(cache key fields differ: ['checkpoint'])") in second.log(), second.log()
    # Why: the daemon's fsync write-protected the page, so this write faulted and set the times.
    assert (after.st_mtime_ns, after.st_ctime_ns) != (identity.st_mtime_ns, identity.st_ctime_ns)
