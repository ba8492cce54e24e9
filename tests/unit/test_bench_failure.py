"""Every failure of bench code names the process that failed and prints its last log lines itself."""

from __future__ import annotations

import ast
import logging
from pathlib import Path

import wcache
from wcache.bench.failure import TAIL_LINES, bench_failure
from wcache.errors import BenchError

PKG = Path(wcache.__file__).parent


def test_the_last_lines_are_logged_before_the_error(caplog):
    text = "\n".join(f"line {i}" for i in range(50)) + "\n\n"
    with caplog.at_level(logging.ERROR, "wcache.bench"):
        err = bench_failure("the daemon's arena record", "daemon", text, waited_s=300)
    assert [r.getMessage() for r in caplog.records] == [f"daemon: line {i}" for i in range(50 - TAIL_LINES, 50)]
    assert str(err) == BenchError.WAITED.format(what="the daemon's arena record", seconds=300, who="daemon",
                                                lines=TAIL_LINES)


def test_an_empty_log_is_said_to_be_empty(caplog):
    with caplog.at_level(logging.ERROR, "wcache.bench"):
        err = bench_failure("a zero_copy sample", "sample", "", code=1)
    assert [r.getMessage() for r in caplog.records] == ["sample: (its log is empty)"]
    assert str(err).endswith("(exit status 1); the sample's last 0 log lines are above")


def test_bench_code_raises_its_errors_only_through_bench_failure():
    """A BenchError built anywhere else in the bench would print no log lines."""
    offenders = []
    modules = sorted((PKG / "bench").glob("*.py"))
    assert len(modules) > 5, modules  # the bench's modules are where this looks
    for path in modules:
        if path.name == "failure.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "BenchError":
                offenders.append(f"{path.name}:{node.lineno}")
    assert not offenders, offenders
