"""Unreadable or incomplete checkpoints fail with a clear error, not a traceback."""

import shutil

import pytest

from wcache.core.checkpoint_files import CheckpointError
from wcache.cli import main
from wcache.core.fingerprint import _hash_file


def test_unreadable_file_is_named(tmp_path):
    # A directory stands in for an unreadable shard: open() fails even for root.
    with pytest.raises(CheckpointError, match=rf"Cannot read checkpoint file {tmp_path}: Is a directory"):
        _hash_file(tmp_path)


def test_missing_shard_exits_2_with_message(tiny_model, tmp_path, wcache_env, capfd):
    broken = tmp_path / "missing"
    shutil.copytree(tiny_model, broken)
    sorted(broken.glob("*.safetensors"))[0].unlink()
    assert main(["serve", str(broken), "--device", "cpu", "--port", "0"]) == 2
    # capfd, not capsys: with two processes (the default) the engine core, a child that shares this
    # process's stderr descriptor, is the one that reads the shards and says what is missing.
    assert "are missing" in capfd.readouterr().err
