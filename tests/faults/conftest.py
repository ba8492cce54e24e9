"""Fault suite fixtures: a private environment and process factory per module, and the one summary
line the suite prints at the end of a run (faults tried, frames fuzzed, crashes, leaked fds)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # faultlib

from attacklib import publish
from faultlib import TALLY, default_socket, rank_pids
import parallel
from procs import Processes, private_env


@pytest.fixture(scope="session")
def fault_autotune_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("fault-autotune")


@pytest.fixture(scope="module")
def fault_env(tmp_path_factory, fault_autotune_dir):
    """A private environment (procs.private_env) for this module, with its own autotune cache."""
    with private_env(tmp_path_factory.mktemp("fault-cache"), prefix="wf-",
                     WCACHE_AUTOTUNE_CACHE_DIR=str(fault_autotune_dir),
                     # the daemons' hand-back records (daemon/arena_record.py), private to this run
                     WCACHE_STATE_DIR=str(tmp_path_factory.mktemp("fault-state"))) as env:
        yield env


@pytest.fixture(scope="module")
def fault_procs(tmp_path_factory, fault_env):
    p = Processes(tmp_path_factory.mktemp("fault-procs"), fault_env)
    yield p
    p.stop_all()


# A module that starts its own `daemon` fixture gets its socket and its one rank's pid from these.
@pytest.fixture(scope="module")
def sock(daemon, fault_env):
    return default_socket(fault_env)


@pytest.fixture(scope="module")
def rank(daemon):
    [pid] = rank_pids(daemon.pid)
    return pid


def pytest_terminal_summary(terminalreporter):
    parallel.section(terminalreporter, "wcache fault suite", [TALLY.line()] if TALLY.faults or TALLY.frames else [])


def pytest_sessionfinish(session):
    """This run's attack figures become docs/faults-attacks.json under WCACHE_WRITE_FIGURES=1, once
    every attack test has run (attacklib.publish); an incomplete run fails instead of writing."""
    why_not = publish()
    if why_not:
        sys.stderr.write(why_not + "\n")
        session.exitstatus = 1
