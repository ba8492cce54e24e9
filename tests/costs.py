"""Tests marked `slow` by their measured cost, not by guess (`make test-fast` leaves them out).

tests/costs.json holds each test's measured seconds (setup + call + teardown), written by
`pytest --record-costs` (`make test-costs`): the run updates the entries of the tests it ran. At
collection, a test whose recorded cost is at least SLOW_S gets the `slow` mark. A test with no
record yet is not marked; record it once it exists. The file is data the suite measured, never
typed by hand.
"""

from __future__ import annotations

import collections
import json
import re
from pathlib import Path

import pytest

COSTS = Path(__file__).with_name("costs.json")
#: Seconds at or above which a test counts as slow: the fast set must finish in under 3 minutes
#: on a 2-core machine (issue arch-1), which this threshold gives with the recorded costs.
SLOW_S = 4.0


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--record-costs", action="store_true",
                     help=f"write each test's measured seconds to {COSTS.name} (marks `slow` by cost)")


def _load() -> dict[str, float]:
    try:
        return json.loads(COSTS.read_text())
    except (OSError, ValueError):
        return {}


_measured: dict[str, float] = collections.defaultdict(float)  # nodeid -> seconds in this run


def mark_slow(items: list[pytest.Item]) -> None:
    costs = _load()
    for item in items:
        cost = costs.get(item.nodeid)
        if cost is not None and cost >= SLOW_S and item.get_closest_marker("slow") is None:
            item.add_marker(pytest.mark.slow)


_recording = False


def configure(config: pytest.Config) -> None:
    global _recording
    _recording = config.getoption("--record-costs") and not hasattr(config, "workerinput")


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Setup, call and teardown of each test (under xdist: in the controller, from every worker).
    Written after each test's teardown, so an interrupted measurement keeps what it measured."""
    if not _recording:
        return
    nodeid = re.sub(r"@[^\[\]@]+$", "", report.nodeid)  # xdist's loadgroup appends "@<group>"
    _measured[nodeid] += report.duration
    if report.when == "teardown":
        costs = _load()
        costs[nodeid] = round(_measured[nodeid], 2)
        COSTS.write_text(json.dumps(dict(sorted(costs.items())), indent=1) + "\n")
