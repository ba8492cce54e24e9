"""Docs tests: the block runner is the package tools/docs_runner (imported from the repository root);
test_tables imports tools/doc_tables.py, tools/plot_bench.py and the other tools as top-level modules."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
for p in (ROOT, ROOT / "tools"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

import parallel  # noqa: E402  (tests/parallel.py: end-of-run sections under xdist)
from tools.docs_runner import coverage  # noqa: E402  (after the sys.path insert)
from tools.docs_runner.substitutions import load_substitutions  # noqa: E402


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """Print the guide's block coverage (run / validated / skipped by reason / unmarked) and the
    substitutions list at the end of any session that ran the docs tests."""
    if not coverage.SESSION.used:
        return
    blocks, errors = coverage.all_blocks()
    summary = coverage.format_summary(blocks, coverage.SESSION, load_substitutions(), errors)
    parallel.section(terminalreporter, "wcache guide: block coverage", summary.splitlines())
