"""The published measurements in docs/benchmarks/: reading the records, and the figures' formats
that every generated table and the chart share (tools/bench_tables.py, tools/plot_bench.py,
tools/matrix_tables.py, tools/gpu_logs.py; tools/doc_tables.py writes them into the pages)."""

from __future__ import annotations

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCH_DIR = ROOT / "docs" / "benchmarks"


# -- loading ---------------------------------------------------------------------------------------


def records(kind_key: str, bench_dir: Path = BENCH_DIR) -> list[tuple[Path, dict]]:
    """The records in ``bench_dir`` that have the key ``kind_key`` (what kind they are), in file-name order."""
    out = []
    for path in sorted(bench_dir.glob("*.json")):
        data = json.loads(path.read_text(encoding="utf-8"))
        if kind_key in data:
            out.append((path, data))
    return out


def bench_records(bench_dir: Path = BENCH_DIR) -> list[tuple[Path, dict]]:
    """``wcache bench --json`` records: the fresh-process ones first (what a restart lives through;
    targets are judged on them), then the older in-process ones, each in file-name order."""
    recs = records("seconds", bench_dir)
    return [r for r in recs if fresh(r[1])] + [r for r in recs if not fresh(r[1])]


def fresh_records(bench_dir: Path = BENCH_DIR) -> list[tuple[Path, dict]]:
    return [r for r in bench_records(bench_dir) if fresh(r[1])]


def older_records(bench_dir: Path = BENCH_DIR) -> list[tuple[Path, dict]]:
    return [r for r in bench_records(bench_dir) if not fresh(r[1])]


def commit_cell(d: dict) -> str:
    """The commit the record measured, as a table shows it (records before 3 December 2026, and
    those made in a tree without .git and without WCACHE_COMMIT, do not say)."""
    commit = d["environment"].get("commit")
    return f"`{commit}`" if commit else "not recorded"


def run_label(path: Path) -> str:
    """``2026-12-02-h200-llama-8b-cuda_ipc.json`` -> ``llama-8b``: the part between the GPU and the
    transport, which names the model the run timed."""
    stem = re.sub(r"^\d{4}-\d{2}-\d{2}-", "", path.stem)
    parts = stem.split("-")
    return "-".join(parts[1:-1]) or stem


# Records made before the vmm_fd arena kind took the transport's own name call it cuda_vmm_fd.
TRANSPORT_NAMES = {"cuda_vmm_fd": "vmm_fd", "vmm_fd": "vmm_fd", "cuda_ipc": "cuda_ipc", "memfd": "memfd"}


def fresh(d: dict) -> bool:
    """Whether every sample of the record ran in a fresh process, as a restarted engine does. Older
    records (no ``sampling`` field) repeated the loads inside one process, whose warm allocator and
    driver made them faster than a restart: they are labelled, and no target is judged on them."""
    return "fresh process" in d.get("sampling", "")


def sampling_label(d: dict) -> str:
    return "fresh process" if fresh(d) else "in-process (older method)"


def transport_of(path: Path, data: dict) -> str:
    kind = data.get("transport")
    return TRANSPORT_NAMES.get(kind, kind) if kind else path.stem.rsplit("-", 1)[-1]


# -- formatting ------------------------------------------------------------------------------------


def fmt_seconds(s: float) -> str:
    if s < 0:
        return f"-{fmt_seconds(-s)}"
    if s >= 1:
        return f"{s:.2f} s"
    if s >= 0.001:
        return f"{s * 1e3:.1f} ms"
    return f"{s * 1e6:.0f} µs"


def fmt_tick(s: float) -> str:
    """An axis tick: a power of ten, in the largest unit that keeps it whole."""
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6)):
        if s >= scale:
            return f"{round(s / scale):d} {unit}"
    return f"{s:g} s"


def fmt_bytes(n: int) -> str:
    if n >= 2**30:
        return f"{n / 2**30:.2f} GiB"
    return f"{n / 2**20:.0f} MiB"


def fmt_ratio(x: float) -> str:
    return f"{x:.1f}x"


NO_RECORD = "No published record has measured this yet."
