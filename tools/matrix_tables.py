"""The namespace/user matrix in the guide, from ``tools/ns_matrix.py --json`` records (a ``rows``
key) in docs/benchmarks/: can an engine map a daemon's weights across each kind of container
boundary, per transport."""

from __future__ import annotations

import re
from pathlib import Path

from bench_records import BENCH_DIR, records


def matrix_records(bench_dir: Path = BENCH_DIR) -> list[tuple[Path, dict]]:
    """``tools/ns_matrix.py --json`` records, in file-name order."""
    return records("rows", bench_dir)


_ERROR_LINE = re.compile(r"^(?:ERROR|WARNING) \S+ \S+ \[[^\]]+\] (?P<msg>.+)$", re.MULTILINE)
_WORKDIR = re.compile(r"/tmp/wcache-ns-[^/\s']+")


def matrix_error(text: str) -> str:
    """The first logged error of a failing case, with the harness's temp directory shortened."""
    m = _ERROR_LINE.search(text)
    msg = m.group("msg") if m else text.strip().splitlines()[-1]
    return _WORKDIR.sub("$WORK", msg)


def matrix_table(bench_dir: Path = BENCH_DIR, link_prefix: str = "benchmarks/") -> str:
    """One row per case, one column per transport: maps, or the error the case ended with."""
    recs = matrix_records(bench_dir)
    cases: list[str] = []
    for _, d in recs:
        cases += [r["case"] for r in d["rows"] if r["case"] not in cases]
    head = "| Case | " + " | ".join(
        f"[`{d['meta']['transport']}`]({link_prefix}{p.name})" for p, d in recs) + " |"
    rows = [head, "| --- |" + " --- |" * len(recs)]
    for case in cases:
        cells = []
        for _, d in recs:
            r = next((r for r in d["rows"] if r["case"] == case), None)
            if r is None:
                cells.append("not run")
            elif r["maps"]:
                cells.append("maps")
            else:
                cells.append(f"fails: `{matrix_error(r.get('error', ''))}`")
        rows.append(f"| {case} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def matrix_runs(bench_dir: Path = BENCH_DIR, link_prefix: str = "benchmarks/") -> str:
    rows = ["| Record | Date | GPU | Driver | torch |", "| --- | --- | --- | --- | --- |"]
    for path, d in matrix_records(bench_dir):
        m = d["meta"]
        rows.append(f"| [{path.name}]({link_prefix}{path.name}) | {m['date']} | {m['gpu']} | {m['driver']} "
                    f"| {m['torch']} |")
    return "\n".join(rows)
