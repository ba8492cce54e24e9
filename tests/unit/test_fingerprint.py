"""The cache key sees every byte of the checkpoint, ignores its directory, and is cheap on restart."""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from wcache.core import fingerprint
from wcache.core.config import EngineConfig, Ranks
from wcache.core.fingerprint import (
    KEY_FIELDS,
    cache_key,
    checkpoint_digest,
    mismatched_fields,
)
from wcache.wire.protocol import PROTOCOL_VERSION


@pytest.fixture
def ckpt(tmp_path, tiny_model, monkeypatch):
    monkeypatch.setenv("WCACHE_CACHE_ROOT", str(tmp_path / "cache"))
    return shutil.copytree(tiny_model, tmp_path / "copy")


def flip(path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x01]))


def offsets(path) -> dict[str, int]:
    size = path.stat().st_size
    header_len = int.from_bytes(path.read_bytes()[:8], "little")
    return {"header length": 0, "json header": 8 + header_len // 2, "first tensor byte": 8 + header_len,
            "middle": (8 + header_len + size) // 2, "last byte": size - 1}


def test_a_single_changed_byte_anywhere_changes_the_key(ckpt):
    cfg = EngineConfig.build(str(ckpt), "auto", None, "cpu")
    base = cache_key(cfg)
    targets = [(f, name, off) for f in sorted(ckpt.glob("*.safetensors")) for name, off in offsets(f).items()]
    targets.append((ckpt / "config.json", "config", 10))
    for f, where, off in targets:
        flip(f, off)
        changed = cache_key(cfg)
        assert mismatched_fields(base, changed) == ["checkpoint"], f"{f.name} {where}: key unchanged"
        flip(f, off)
        assert cache_key(cfg) == base, f"{f.name} {where}: restoring the byte did not restore the key"


def test_a_zeroed_norm_tensor_changes_the_key(ckpt):
    """Upstream's open bug: same shapes, so the same header; only the values differ."""
    before = checkpoint_digest(ckpt)[0]
    shard = next(f for f in ckpt.glob("*.safetensors") if "model.norm.weight" in safe_open(str(f), "pt").keys())  # noqa: SIM118
    size = shard.stat().st_size
    tensors = load_file(str(shard))
    tensors["model.norm.weight"] = torch.zeros_like(tensors["model.norm.weight"])
    save_file(tensors, str(shard), metadata={"format": "pt"})
    assert shard.stat().st_size == size
    assert checkpoint_digest(ckpt)[0] != before


def test_the_same_files_in_another_directory_give_the_same_key(ckpt, tmp_path):
    elsewhere = shutil.copytree(ckpt, tmp_path / "elsewhere" / "model")
    a = EngineConfig.build(str(ckpt), "auto", None, "cpu")
    b = EngineConfig.build(str(elsewhere), "auto", None, "cpu")
    assert checkpoint_digest(ckpt)[0] == checkpoint_digest(elsewhere)[0]
    assert mismatched_fields(cache_key(a), cache_key(b)) == []


def test_restart_hashes_nothing_and_a_same_size_write_rehashes(ckpt, monkeypatch):
    monkeypatch.setattr(fingerprint, "RACY_WINDOW_NS", 50_000_000)
    time.sleep(0.06)  # the copies are now older than the (shortened) racy window
    total = sum(p.stat().st_size for p in list(ckpt.glob("*.safetensors")) + [ckpt / "config.json"])
    digest, first = checkpoint_digest(ckpt)
    assert first == {"files": 3, "files_hashed": 3, "bytes_hashed": total, "files_unsettled": 0}
    again, second = checkpoint_digest(ckpt)
    assert again == digest and second == {"files": 3, "files_hashed": 0, "bytes_hashed": 0, "files_unsettled": 0}
    shard = sorted(ckpt.glob("*.safetensors"))[1]
    flip(shard, shard.stat().st_size // 2)  # content changes, size and inode stay
    changed, third = checkpoint_digest(ckpt)
    assert changed != digest
    # The rewritten shard is too fresh to remember: the bench waits such files out.
    assert third == {"files": 3, "files_hashed": 1, "bytes_hashed": shard.stat().st_size, "files_unsettled": 1}


def test_a_file_written_just_before_hashing_is_not_remembered(ckpt):
    """Its timestamp may be as coarse as a second: a later write could look identical."""
    assert fingerprint.RACY_WINDOW_NS >= 1_000_000_000
    checkpoint_digest(ckpt)
    assert checkpoint_digest(ckpt)[1]["files_hashed"] == 3


def test_key_has_every_field_and_reports_the_ones_that_differ(tiny_model):
    cfg = EngineConfig.build(str(tiny_model), "auto", None, "cpu")
    key = cache_key(cfg, digest="d" * 64)
    assert tuple(key) == KEY_FIELDS
    assert key["protocol_version"] == PROTOCOL_VERSION and key["device_kind"] == "cpu"
    assert key["dtype"] == "bfloat16" and key["quantization"] == "none" and key["revision"] == "main"
    variants = {
        ("dtype",): EngineConfig.build(str(tiny_model), "float32", None, "cpu"),
        ("quantization", "quantization_config"): EngineConfig.build(str(tiny_model), "auto", "int8", "cpu"),
        ("revision",): EngineConfig.build(str(tiny_model), "auto", None, "cpu", revision="v2"),
        ("tp_rank", "tp_size"): cfg.for_rank(Ranks(tp_size=2, tp_rank=1)),
        ("pp_size",): cfg.for_rank(Ranks(pp_size=2)),
    }
    for fields, other in variants.items():
        assert mismatched_fields(key, cache_key(other, digest="d" * 64)) == list(fields)


def test_a_write_through_a_dirty_page_changes_no_time_until_the_page_is_written_back(tmp_path):
    """Why a digest is remembered only for a file written back before it was hashed (fingerprint.py)."""
    import mmap
    import os

    f = tmp_path / "shard"
    f.write_bytes(bytes(8192))
    with open(f, "r+b") as fh, mmap.mmap(fh.fileno(), 0) as m:
        time.sleep(0.05)
        m[0] = 1  # the fault that makes the page writable sets the times
        dirty = os.stat(f)
        time.sleep(0.05)
        m[1] = 1  # the page is dirty and writable: no fault, no time
        assert os.stat(f).st_mtime_ns == dirty.st_mtime_ns and os.stat(f).st_ctime_ns == dirty.st_ctime_ns
        if fingerprint._filesystem_type(dirty) in fingerprint.MEMORY_FILESYSTEMS:
            return  # no writeback there, so the fsync below would change nothing: never remembered
        fingerprint._hash_file(f)  # written back: the page is write-protected again
        time.sleep(0.05)
        m[2] = 1
        assert os.stat(f).st_mtime_ns > dirty.st_mtime_ns


def test_a_checkpoint_on_a_memory_filesystem_is_never_remembered(tiny_model, tmp_path, monkeypatch):
    shm = Path("/dev/shm")
    if not shm.is_dir() or fingerprint._filesystem_type(shm.stat()) != "tmpfs":
        pytest.skip("/dev/shm is not a tmpfs here")
    monkeypatch.setenv("WCACHE_CACHE_ROOT", str(tmp_path / "cache"))
    monkeypatch.setattr(fingerprint, "RACY_WINDOW_NS", 0)
    copy = Path(tempfile.mkdtemp(dir=shm, prefix="wcache-test-"))
    try:
        shutil.copytree(tiny_model, copy, dirs_exist_ok=True)
        time.sleep(0.01)
        assert checkpoint_digest(copy)[1]["files_unsettled"] == 3
        assert checkpoint_digest(copy)[1]["files_hashed"] == 3  # hashed again on every start
    finally:
        shutil.rmtree(copy)


def test_digests_remembered_without_a_writeback_are_hashed_again(ckpt, monkeypatch):
    """Entries written by a version that did not fsync first may be digests of a dirty page."""
    monkeypatch.setattr(fingerprint, "RACY_WINDOW_NS", 0)
    time.sleep(0.01)
    checkpoint_digest(ckpt)
    memo_file = fingerprint._memo_path(ckpt)
    memo = json.loads(memo_file.read_text())
    assert len(memo) == 3 and all(e["written_back"] is True for e in memo.values())
    memo_file.write_text(json.dumps({n: {"identity": e["identity"], "sha256": e["sha256"]} for n, e in memo.items()}))
    assert checkpoint_digest(ckpt)[1]["files_hashed"] == 3
