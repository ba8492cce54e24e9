"""Docs tests: the block runner lives in tools/blocks.py, imported from tools/ (not a package)."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT / "tools") not in sys.path:
    sys.path.insert(0, str(ROOT / "tools"))

import blocks  # after the sys.path insert


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """Print the guide's block coverage (run / validated / skipped by reason / unmarked) and the
    substitutions list at the end of any session that ran the docs tests."""
    if not blocks.SESSION.used:
        return
    all_blocks, errors = blocks.all_blocks()
    terminalreporter.write_sep("-", "wcache guide: block coverage")
    summary = blocks.format_summary(all_blocks, blocks.SESSION, blocks.load_substitutions(), errors)
    for line in summary.splitlines():
        terminalreporter.write_line(line)
