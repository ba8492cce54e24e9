"""Shared fixtures: checkpoints made once per session, a private environment per test."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # tests/procs.py

from procs import Processes  # noqa: E402

from wcache.checkpoint import make_checkpoint  # noqa: E402


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny", "tiny")


@pytest.fixture(scope="session")
def tiny_tied_model(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny-tied", "tiny", tie_embeddings=True)


@pytest.fixture
def wcache_env(tmp_path, monkeypatch) -> dict:
    """A private TMPDIR (so the default socket dir is the test's own) and cache root, for this
    process and every process the test starts."""
    # Short: a Unix socket path must fit in 107 bytes, and pytest's tmp_path is long.
    tmp = Path(tempfile.mkdtemp(prefix="wc-", dir="/tmp"))
    env = {**os.environ, "TMPDIR": str(tmp), "WCACHE_CACHE_ROOT": str(tmp_path / "cache"), "PYTHONUNBUFFERED": "1"}
    monkeypatch.setenv("TMPDIR", env["TMPDIR"])
    monkeypatch.setenv("WCACHE_CACHE_ROOT", env["WCACHE_CACHE_ROOT"])
    monkeypatch.setattr(tempfile, "tempdir", None)  # re-read TMPDIR in this process
    yield env
    shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture
def procs(tmp_path, wcache_env):
    p = Processes(tmp_path, wcache_env)
    yield p
    p.stop_all()
