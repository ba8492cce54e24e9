"""Shared fixtures: checkpoints made once per session, a private environment per test."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # tests/procs.py

from costs import (pytest_addoption, pytest_collection_modifyitems,  # noqa: E402,F401  (hooks: slow by cost)
                   pytest_configure, pytest_runtest_logreport)
from procs import Processes, private_env  # noqa: E402

from wcache.core.checkpoint import make_checkpoint  # noqa: E402


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny", "tiny")


@pytest.fixture(scope="session")
def tiny_tied_model(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny-tied", "tiny", tie_embeddings=True)


@pytest.fixture
def wcache_env(tmp_path) -> dict:
    """A private TMPDIR (so the default socket dir is the test's own) and cache root, for this
    process and every process the test starts."""
    with private_env(tmp_path / "cache") as env:
        yield env


@pytest.fixture
def procs(tmp_path, wcache_env):
    p = Processes(tmp_path, wcache_env)
    yield p
    p.stop_all()
