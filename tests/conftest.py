"""Shared fixtures: checkpoints made once per session, a private environment per test."""

from __future__ import annotations

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
