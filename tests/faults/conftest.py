"""Fault suite fixtures: a private environment and process factory per module, and the one summary
line the suite prints at the end of a run (faults tried, frames fuzzed, crashes, leaked fds)."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # faultlib

from faultlib import TALLY
from procs import Processes


@pytest.fixture(scope="session")
def fault_autotune_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("fault-autotune")


@pytest.fixture(scope="module")
def fault_env(tmp_path_factory, fault_autotune_dir):
    """A short private TMPDIR (so the default socket dir is this module's own) and cache roots, for
    this process and every process the module starts."""
    tmp = Path(tempfile.mkdtemp(prefix="wf-", dir="/tmp"))  # short: sun_path holds 107 bytes
    env = {**os.environ, "TMPDIR": str(tmp), "WCACHE_CACHE_ROOT": str(tmp_path_factory.mktemp("fault-cache")),
           "WCACHE_AUTOTUNE_CACHE_DIR": str(fault_autotune_dir), "PYTHONUNBUFFERED": "1"}
    mp = pytest.MonkeyPatch()
    for k in ("TMPDIR", "WCACHE_CACHE_ROOT", "WCACHE_AUTOTUNE_CACHE_DIR"):
        mp.setenv(k, env[k])
    mp.setattr(tempfile, "tempdir", None)  # re-read TMPDIR in this process
    yield env
    mp.undo()
    shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture(scope="module")
def fault_procs(tmp_path_factory, fault_env):
    p = Processes(tmp_path_factory.mktemp("fault-procs"), fault_env)
    yield p
    p.stop_all()


def pytest_terminal_summary(terminalreporter):
    if TALLY.faults or TALLY.frames:
        terminalreporter.write_sep("-", "wcache fault suite")
        terminalreporter.write_line(TALLY.line())
