"""The published pytest logs of GPU runs (``docs/benchmarks/*.log``): one summary row each, with the
tests that failed, for the guide's validation page."""

from __future__ import annotations

import re
from pathlib import Path

from bench_records import BENCH_DIR


# pytest's last line: counts of passed or failed tests, or of collection errors (a run that stopped there).
_SUMMARY = re.compile(r"^=+ (?P<s>.*\d+ (?:passed|failed|errors?)\b.*?) =+$|^(?P<t>\d+ (?:passed|failed)[^=]*)$",
                      re.MULTILINE)


def gpu_test_logs(bench_dir: Path = BENCH_DIR) -> list[Path]:
    """The published pytest logs of GPU runs, in file-name order."""
    return sorted(bench_dir.glob("*.log"))


def gpu_tests_summary(bench_dir: Path = BENCH_DIR, link_prefix: str = "benchmarks/") -> str:
    """One row per published GPU test log: its pytest summary line and the tests that failed."""
    rows = ["| Log | Result | Failed |", "| --- | --- | --- |"]
    for log in gpu_test_logs(bench_dir):
        text = log.read_text(encoding="utf-8")
        found = [m.group("s") or m.group("t") for m in _SUMMARY.finditer(text)]
        if not found:
            raise ValueError(f"{log}: no pytest summary line")
        # pytest's short summary: a failed test, or a test file that could not be collected
        # the tier's workers (tools/gpu_worker.py) name a test twice, ``ID@ID``: once is enough
        failed = ", ".join(dict.fromkeys(f"`{m.group(1)}`" for m in re.finditer(r"^(?:FAILED|ERROR) (tests/[^\s@]+)",
                                                                               text, re.MULTILINE)))
        rows.append(f"| [{log.name}]({link_prefix}{log.name}) | `{found[-1].strip()}` | {failed or 'none'} |")
    return "\n".join(rows)
