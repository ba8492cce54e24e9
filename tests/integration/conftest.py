"""Integration fixtures: module-scoped private environments and daemons, the small checkpoint.
Plain helpers live in itest.py: test modules import them from there, never from `conftest`, a
name that every test directory's conftest shares."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from procs import Processes, private_env
from wcache import cli



@pytest.fixture(scope="session")
def autotune_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("autotune")


@pytest.fixture(scope="module", autouse=True)
def shared_autotune_cache(autotune_dir):
    """Daemons and engines tune once per configuration for the whole session, then load the result
    (each fresh cache root would otherwise pay a multi-second autotune pass per daemon)."""
    mp = pytest.MonkeyPatch()
    mp.setenv("WCACHE_AUTOTUNE_CACHE_DIR", str(autotune_dir))
    yield
    mp.undo()


@pytest.fixture(scope="module")
def module_env(tmp_path_factory):
    """Like `wcache_env`, for a whole module (so one daemon can serve several tests)."""
    with private_env(tmp_path_factory.mktemp("cache")) as env:
        yield env


@pytest.fixture(scope="module")
def module_procs(tmp_path_factory, module_env):
    p = Processes(tmp_path_factory.mktemp("procs"), module_env)
    yield p
    p.stop_all()


@pytest.fixture
def own_autotune_cache(procs, monkeypatch):
    """No session-wide shared autotune dir: each process uses <its cache root>/autotune."""
    procs.env.pop("WCACHE_AUTOTUNE_CACHE_DIR", None)
    monkeypatch.delenv("WCACHE_AUTOTUNE_CACHE_DIR", raising=False)


@pytest.fixture
def cfg(tiny_model):
    """The tiny model's engine configuration on CPU."""
    from wcache.core.config import EngineConfig

    return EngineConfig.build(str(tiny_model), "auto", None, "cpu")


@pytest.fixture
def main(capfd):
    """Run `wcache ...` in this process: (exit status, what it printed)."""
    root = logging.getLogger()
    saved = root.handlers[:], root.level

    def run(*args):
        try:
            code = cli.main(list(args))
        finally:
            root.handlers[:], _ = saved[0], root.setLevel(saved[1])  # cli.main installs its own handler
        out, err = capfd.readouterr()
        return code, out + err

    run.capfd = capfd  # for what a run that raised SystemExit printed
    return run
