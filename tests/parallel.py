"""The suite on several workers (pytest-xdist, `make test`: `-n 2 --dist loadgroup`).

Groups: every test file is one group, so a module's daemon fixture starts once. A directory whose
tests share something machine-wide is one group, run by one worker in collection order:

* tests/docs: the guide's pages listen on fixed ports (8000, 8001-8305, 29600, 29700, 47100), as
  a reader's copy would;
* tests/docker: one Docker engine, started and stopped by the tier;
* tests/faults: one tally, printed at the end (`faults tried: ...`);
* tests/browser: one built site and one Chromium.

In the GPU tier (tools/gpu_tier.sh) each worker has a loopback of its own (tools/gpu_worker.py sets
``WCACHE_TEST_OWN_LOOPBACK``): the pages' ports no longer collide, so every test is its own group
there, and the pages and GPU tests spread over the GPU host's cores.

End-of-run sections (the fault tally, the guide's block coverage, the docker timings) are printed
by the worker that ran those tests, whose terminal nobody sees; `section` writes them to a file
the controller prints instead. Without xdist it prints directly.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest

ONE_GROUP_DIRS = ("docs", "docker", "faults", "browser")
RELAY_ENV = "WCACHE_TEST_SECTIONS_DIR"
OWN_LOOPBACK_ENV = "WCACHE_TEST_OWN_LOOPBACK"  # tools/gpu_worker.py
TESTS = Path(__file__).parent


def group_of(item: pytest.Item) -> str:
    if os.environ.get(OWN_LOOPBACK_ENV):
        return item.nodeid
    rel = Path(item.path).relative_to(TESTS)
    return rel.parts[0] if rel.parts[0] in ONE_GROUP_DIRS else rel.as_posix()


def add_groups(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _workers(config) == 0 and not hasattr(config, "workerinput"):
        return  # no xdist here: the mark would mean nothing (and may not be registered)
    for item in items:
        if item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(group_of(item)))


def _workers(config: pytest.Config) -> int:
    n = getattr(config.option, "numprocesses", None)
    return n if isinstance(n, int) else 0


def configure(config: pytest.Config) -> None:
    """In the controller of a run with workers: a directory for their sections (workers inherit
    the environment, so they find it)."""
    if not hasattr(config, "workerinput") and _workers(config) > 0:
        os.environ[RELAY_ENV] = tempfile.mkdtemp(prefix="wcache-sections-")


def section(terminalreporter, title: str, lines: list[str]) -> None:
    """Print an end-of-run section, or hand it to the controller when this is a worker."""
    if not lines:
        return
    config = terminalreporter.config
    if hasattr(config, "workerinput") and os.environ.get(RELAY_ENV):
        worker = config.workerinput["workerid"]
        with open(Path(os.environ[RELAY_ENV]) / f"{worker}.jsonl", "a", encoding="utf-8") as f:
            f.write(json.dumps({"title": title, "lines": lines}) + "\n")
        return
    terminalreporter.write_sep("-", title)
    for line in lines:
        terminalreporter.write_line(line)


def print_relayed(terminalreporter) -> None:
    """In the controller: the sections the workers wrote, in worker order."""
    if hasattr(terminalreporter.config, "workerinput") or not os.environ.get(RELAY_ENV):
        return
    relay = Path(os.environ.pop(RELAY_ENV))
    for path in sorted(relay.glob("*.jsonl")):
        for row in path.read_text(encoding="utf-8").splitlines():
            s = json.loads(row)
            section(terminalreporter, s["title"], s["lines"])
    shutil.rmtree(relay, ignore_errors=True)
