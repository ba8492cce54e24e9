"""A shard-less model directory stands for the checkpoint its source hashed: with the source's shard
list remembered, its digest is the real directory's; without the list, with another list, or with a
shard present, the list is not used."""

from __future__ import annotations

import json
import shutil

import pytest
from wcache.core import seeded_checkpoint
from wcache.core.checkpoint_files import CheckpointError
from wcache.core.fingerprint import checkpoint_digest


@pytest.fixture
def bare(tmp_path, tiny_model, monkeypatch):
    monkeypatch.setenv("WCACHE_CACHE_ROOT", str(tmp_path / "root"))
    d = tmp_path / "bare"
    d.mkdir()
    for f in tiny_model.iterdir():
        if not f.name.endswith(".safetensors"):
            shutil.copy(f, d / f.name)
    return d


def test_the_remembered_list_gives_the_sources_digest(bare, tiny_model, tmp_path):
    files: dict = {}
    digest, _ = checkpoint_digest(tiny_model, entries=files)
    shards = {n: e for n, e in files.items() if n != "config.json"}
    with pytest.raises(CheckpointError, match="are missing"):
        checkpoint_digest(bare)  # nothing remembered: the missing shards are named, as before
    assert not seeded_checkpoint.has_shards(bare) and seeded_checkpoint.has_shards(tiny_model)
    seeded_checkpoint.write(bare, tmp_path / "root", shards, "127.0.0.1:1")
    assert checkpoint_digest(bare)[0] == digest
    assert seeded_checkpoint.small_identity(bare) == seeded_checkpoint.small_identity(tiny_model)


def test_another_list_or_another_config_is_not_the_sources_digest(bare, tiny_model, tmp_path):
    files: dict = {}
    digest, _ = checkpoint_digest(tiny_model, entries=files)
    shards = {n: e for n, e in files.items() if n != "config.json"}
    first = sorted(shards)[0]
    seeded_checkpoint.write(bare, tmp_path / "root", {first: shards[first]}, "x")  # a list missing a shard
    with pytest.raises(CheckpointError):
        checkpoint_digest(bare)
    seeded_checkpoint.write(bare, tmp_path / "root", shards, "x")
    config = json.loads((bare / "config.json").read_text())
    (bare / "config.json").write_text(json.dumps({**config, "rms_norm_eps": 1e-3}))
    assert checkpoint_digest(bare)[0] != digest  # config.json is hashed where it lies
