"""Shared fixtures: checkpoints made once per session, a private environment per test."""

from __future__ import annotations

import fcntl
import os
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # tests/procs.py

import costs  # noqa: E402  (tests marked slow by measured cost)
import parallel  # noqa: E402  (groups and end-of-run sections under pytest-xdist)
from procs import Processes, private_env  # noqa: E402

from wcache.core.checkpoint import make_checkpoint  # noqa: E402


pytest_addoption = costs.pytest_addoption
pytest_runtest_logreport = costs.pytest_runtest_logreport


def pytest_configure(config: pytest.Config) -> None:
    costs.configure(config)
    parallel.configure(config)


@pytest.hookimpl(tryfirst=True)  # before xdist appends each test's group to its node id
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    costs.mark_slow(items)
    parallel.add_groups(config, items)


def pytest_terminal_summary(terminalreporter) -> None:
    parallel.print_relayed(terminalreporter)


SHARED_CHECKPOINTS_ENV = "WCACHE_TEST_CHECKPOINTS"  # tools/gpu_tier.sh: one directory for every worker


def checkpoint(tmp_path_factory, name: str, preset: str, **options) -> Path:
    """A checkpoint the tests read and never change: made once per run where the run shares a
    directory among its workers (the GPU tier: a small checkpoint is 469 MiB, written by each of 8
    workers otherwise), else once per process in its temporary directory. make_checkpoint is
    deterministic, so every worker reads the same bytes either way."""
    shared = os.environ.get(SHARED_CHECKPOINTS_ENV)
    if not shared:
        return make_checkpoint(tmp_path_factory.mktemp("ckpt") / name, preset, **options)
    root = Path(shared)
    root.mkdir(parents=True, exist_ok=True)
    path = root / name
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one worker writes it; the others wait, then read it
        if not (path / "config.json").exists():
            partial = root / f".{name}.partial"
            shutil.rmtree(partial, ignore_errors=True)
            make_checkpoint(partial, preset, **options)
            partial.rename(path)
    return path


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    return checkpoint(tmp_path_factory, "tiny", "tiny")


@pytest.fixture(scope="session")
def tiny_tied_model(tmp_path_factory) -> Path:
    return checkpoint(tmp_path_factory, "tiny-tied", "tiny", tie_embeddings=True)


@pytest.fixture(scope="session")
def small_model(tmp_path_factory) -> Path:
    return checkpoint(tmp_path_factory, "small", "small")


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
