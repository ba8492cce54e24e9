"""Render the published measurements in docs/benchmarks/ as Markdown tables and an SVG bar chart.

Every figure the guide shows about a GPU run comes from a JSON record in ``docs/benchmarks/`` through
this module, never typed by hand:

* ``wcache bench --json`` records (a ``seconds`` key): the restart table, the table of runs (date,
  GPU, driver, torch of each) and ``docs/benchmarks/restart-h200.svg``;
* ``tools/ns_matrix.py --json`` records (a ``rows`` key): the namespace/user matrix table;
* the GPU test logs (``*.log``): their pytest summary lines and failures.

The tables live between ``<!-- generated: NAME -->`` and ``<!-- end generated -->`` comments in the
pages; ``tools/doc_tables.py`` rewrites or checks them, and ``tests/docs/test_tables.py`` fails when
a page or the SVG differs from what this module renders from the JSON.

    python tools/plot_bench.py            # rewrite the SVG
    python tools/plot_bench.py --check    # exit 1 if the committed SVG is stale

No plotting library: the SVG is written by hand, deterministically (fixed number formats, files in
name order), so regenerating it from the same JSON gives the same bytes.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from pathlib import Path
from xml.sax.saxutils import escape

ROOT = Path(__file__).resolve().parent.parent
BENCH_DIR = ROOT / "docs" / "benchmarks"
SVG_PATH = BENCH_DIR / "restart-h200.svg"


SOURCES = (("disk", "disk (warm page cache)", "#8d8d8d"),
           ("zero_copy", "ipc_cache zero_copy", "#1e6fd9"),
           ("copy", "ipc_cache copy", "#2e9d4f"))


# -- loading ---------------------------------------------------------------------------------------


def _records(kind_key: str, bench_dir: Path = BENCH_DIR) -> list[tuple[Path, dict]]:
    out = []
    for path in sorted(bench_dir.glob("*.json")):
        data = json.loads(path.read_text(encoding="utf-8"))
        if kind_key in data:
            out.append((path, data))
    return out


def bench_records(bench_dir: Path = BENCH_DIR) -> list[tuple[Path, dict]]:
    """``wcache bench --json`` records: the fresh-process ones first (what a restart lives through;
    targets are judged on them), then the older in-process ones, each in file-name order."""
    recs = _records("seconds", bench_dir)
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


def matrix_records(bench_dir: Path = BENCH_DIR) -> list[tuple[Path, dict]]:
    """``tools/ns_matrix.py --json`` records, in file-name order."""
    return _records("rows", bench_dir)


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


# -- tables ----------------------------------------------------------------------------------------


def speedup(d: dict) -> float:
    """Disk over zero_copy: the ratio the record itself states (``wcache bench`` computes it from the
    unrounded medians), so every page that quotes it shows the same figure."""
    ratio = d.get("ratios", {}).get("disk_over_zero_copy")
    return ratio if ratio is not None else d["seconds"]["disk"] / d["seconds"]["zero_copy"]


def _restart_rows(recs: list[tuple[Path, dict]], first: str) -> str:
    rows = [f"| Model | Transport | {first} | Tensors | Weights | Disk | zero_copy | copy | Disk / zero_copy |",
            "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for path, d in recs:
        s, m = d["seconds"], d["model"]
        label = commit_cell(d) if first == "Commit" else sampling_label(d)
        rows.append(
            f"| {run_label(path)} | `{transport_of(path, d)}` | {label} | {m['tensors']:,} "
            f"| {fmt_bytes(m['bytes'])} | {fmt_seconds(s['disk'])} | {fmt_seconds(s['zero_copy'])} "
            f"| {fmt_seconds(s['copy'])} | {fmt_ratio(speedup(d))} |")
    return "\n".join(rows)


def bench_table(bench_dir: Path = BENCH_DIR) -> str:
    """Restart timings of the fresh-process records, with the commit each measured (the key's cost
    is in bench_keys_table, so that neither table is wider than the page)."""
    recs = fresh_records(bench_dir)
    return _restart_rows(recs, "Commit") if recs else NO_RECORD


def bench_table_older(bench_dir: Path = BENCH_DIR) -> str:
    """The older in-process records, apart: their samples ran in one warm process."""
    recs = older_records(bench_dir)
    return _restart_rows(recs, "Sampling") if recs else NO_RECORD


def bench_keys_table(bench_dir: Path = BENCH_DIR) -> str:
    """The cache key's checkpoint hash per record: first sight (reads every byte) and restart."""
    rows = ["| Model | Transport | Weights | Disk | Key, first sight | Key, restart |",
            "| --- | --- | ---: | ---: | ---: | ---: |"]
    for path, d in bench_records(bench_dir):
        s, m = d["seconds"], d["model"]
        rows.append(f"| {run_label(path)} | `{transport_of(path, d)}` | {fmt_bytes(m['bytes'])} | {fmt_seconds(s['disk'])} "
                    f"| {fmt_seconds(s['key_first_sight'])} | {fmt_seconds(s['key_restart'])} |")
    return "\n".join(rows)


def phases_table(bench_dir: Path = BENCH_DIR, key: str = "zero_copy_phases_ms") -> str:
    """Where a zero_copy (or, with ``copy_phases_ms``, a copy) handoff spends its time, for the
    records that have the phases."""
    recs = [(p, d) for p, d in bench_records(bench_dir) if d.get(key)]
    if not recs:
        return NO_RECORD
    names: list[str] = []
    for _, d in recs:
        names += [k for k in d[key] if k not in names]
    rows = ["| Model | Transport | Sampling | " + " | ".join(names) + " |",
            "| --- | --- | --- |" + " ---: |" * len(names)]
    for path, d in recs:
        ph = d[key]
        rows.append(f"| {run_label(path)} | `{transport_of(path, d)}` | {sampling_label(d)} | "
                    + " | ".join(f"{ph[n]:.3f} ms" if n in ph else "" for n in names) + " |")
    return "\n".join(rows)


# The targets for the CUDA path ([gpu-1], [gpu-4], raised by [gpu-5]), judged on fresh-process
# records only: (label, model, what is measured, target, higher is better).
TARGETS = [
    ("zero_copy handoff, 16 GB model", "llama-8b", "zero_copy", 0.003, False),
    ("zero_copy handoff, 10,000 tensors", "tensors-10k", "zero_copy", 0.020, False),
    ("copy mode, effective bandwidth", "llama-8b", "copy_tb_s", 1.2, True),
    ("weights ready vs a warm-cache disk load", "llama-8b", "speedup", 300.0, True),
    ("engine start via the cache, above the floor", "llama-8b", "start_over_floor", 0.25, False),
    ("engine start: disk over the cache", "llama-8b", "start_ratio", 3.5, True),
]
# Why a fresh-process record of the target's model has no value for it.
NOT_IN_RECORD = {"start_over_floor": "not measured: the record has no start floor (interpreter, torch, CUDA context)",
                 "start_ratio": "not measured: the record has no engine start"}


def _target_value(d: dict, what: str) -> float | None:
    s = d["seconds"]
    if what == "copy_tb_s":
        return d["model"]["bytes"] / s["copy"] / 1e12
    if what == "speedup":
        return speedup(d)
    start = d.get("engine_start")
    if what == "start_over_floor":
        return start.get("ipc_cache_over_floor_s") if start else None
    if what == "start_ratio":
        return start["disk_over_ipc_cache"] if start else None
    return s[what]


def _target_cell(what: str, v: float) -> str:
    if what == "start_over_floor":  # below the floor: the CUDA context was made during the imports
        return f"+{fmt_seconds(v)}" if v >= 0 else fmt_seconds(v)
    return {"copy_tb_s": f"{v:.2f} TB/s", "speedup": fmt_ratio(v), "start_ratio": fmt_ratio(v)}.get(what) \
        or fmt_seconds(v)


def targets_table(bench_dir: Path = BENCH_DIR) -> str:
    """Each GPU target against every record of its model: met, or the factor still missing."""
    rows = ["| Target | Model | Transport | Commit | Goal | Measured | Result |",
            "| --- | --- | --- | --- | ---: | ---: | --- |"]
    for label, model, what, goal, higher in TARGETS:
        sign = ">=" if higher else "<="
        goal_cell = _target_cell(what, goal)
        judged = [(p, d) for p, d in fresh_records(bench_dir) if run_label(p) == model]
        if not judged:
            rows.append(f"| {label} | {model} | | | {sign} {goal_cell} | | "
                        "not measured yet with fresh-process sampling |")
        for path, d in judged:
            v = _target_value(d, what)
            where = f"| {label} | {model} | `{transport_of(path, d)}` | {commit_cell(d)} | {sign} {goal_cell} "
            if v is None:
                rows.append(where + f"| | {NOT_IN_RECORD[what]} |")
                continue
            met = v >= goal if higher else v <= goal
            factor = goal / v if higher else v / goal
            result = "met" if met else f"missed: {factor:.1f}x short"
            rows.append(where + f"| {_target_cell(what, v)} | {result} |")
    return "\n".join(rows)


def copy_phases_table(bench_dir: Path = BENCH_DIR) -> str:
    return phases_table(bench_dir, "copy_phases_ms")


# The rows of an engine-start record: each load format, and the floor (a bare interpreter that
# imports torch and makes its CUDA context, in the same run), where the record has it.
_START_ROWS = {"disk": "`safetensors`", "ipc_cache": "`ipc_cache`", "floor": "floor: `import torch`, CUDA context"}


def engine_start_table(bench_dir: Path = BENCH_DIR) -> str:
    """An engine process from spawn to /health 200, disk against the cache, and where its own
    start-up spends the time (bench/start.py ENGINE_PHASES), for the records that timed it."""
    recs = [(p, d) for p, d in bench_records(bench_dir) if d.get("engine_start")]
    if not recs:
        return NO_RECORD
    names: list[str] = []
    for _, d in recs:
        for fmt in _START_ROWS:
            names += [k for k in d["engine_start"].get(fmt, {}).get("phases_s", {}) if k not in names]
    rows = ["| Model | Transport | Load format | To /health 200 | " + " | ".join(names) + " |",
            "| --- | --- | --- | ---: |" + " ---: |" * len(names)]
    for path, d in recs:
        for fmt, shown in _START_ROWS.items():
            e = d["engine_start"].get(fmt)
            if e is None:
                continue
            rows.append(f"| {run_label(path)} | `{transport_of(path, d)}` | {shown} "
                        f"| {fmt_seconds(e['seconds'])} | "
                        + " | ".join(fmt_seconds(e["phases_s"][n]) if n in e["phases_s"] else "-" for n in names) + " |")
    return "\n".join(rows)


def restart_records(bench_dir: Path = BENCH_DIR) -> list[tuple[Path, dict]]:
    """Records with a daemon restart: the GPU records, and the CPU ones kept apart in ``cpu/`` (so the
    GPU tables and chart never mix them in)."""
    return [(p, d) for sub in (bench_dir, bench_dir / "cpu") for p, d in bench_records(sub) if d.get("handback")]


def handback_table(bench_dir: Path = BENCH_DIR, link_prefix: str = "benchmarks/") -> str:
    """A daemon killed under a running zero_copy engine, and the next one to READY, against the
    run's first start and its floor (a fresh interpreter importing torch)."""
    rows = ["| Record | Device | Transport | First start to READY | Restart to READY | Floor | Restart / first start "
            "| The restarted daemon | Standby takeover to READY | Standby / first start |",
            "| --- | --- | --- | ---: | ---: | ---: | ---: | --- | ---: | ---: |"]
    for path, d in restart_records(bench_dir):
        h = d["handback"]
        record, dev = restart_record_cells(path, d, bench_dir, link_prefix)
        if h.get("skipped"):
            rows.append(f"| {record} | {dev} | `{transport_of(path, d)}` | | | | | skipped: {h['skipped']} | | |")
            continue
        floor = fmt_seconds(h["floor_s"]) if "floor_s" in h else ""
        ratio = f"{h['restart_to_ready_s'] / h['first_start_to_ready_s']:.0%}"
        standby = standby_cells(h)
        rows.append(f"| {record} | {dev} | `{transport_of(path, d)}` | {fmt_seconds(h['first_start_to_ready_s'])} "
                    f"| {fmt_seconds(h['restart_to_ready_s'])} | {floor} | {ratio} "
                    f"| {'adopted the running engine' + chr(39) + 's arena' if h['adopted'] else 'loaded from disk'} "
                    f"| {standby[0]} | {standby[1]} |")
    return "\n".join(rows) if len(rows) > 2 else NO_RECORD


def restart_record_cells(path: Path, d: dict, bench_dir: Path, link_prefix: str) -> tuple[str, str]:
    """A restart table's first two cells: the record, linked, and its device."""
    return (f"[{run_label(path)}]({link_prefix}{path.relative_to(bench_dir).as_posix()})",
            d["environment"].get("gpu", d["environment"]["device"]))


def standby_cells(h: dict) -> tuple[str, str]:
    """The standby takeover's time and its share of the first start; '-' for a record before it."""
    if "standby_takeover_s" not in h:
        return "-", "-"
    took = fmt_seconds(h["standby_takeover_s"]) + ("" if h["standby_adopted"] else " (loaded from disk)")
    return took, f"{h['standby_over_first_start']:.0%}"


def standby_table(bench_dir: Path = BENCH_DIR, link_prefix: str = "benchmarks/") -> str:
    """What a standby daemon cost and saved in each bench record that measured one (bench/restart.py)."""
    rows = ["| Record | Device | Transport | Host memory while standing by | SIGKILL of the serving daemon to the "
            "standby's READY | Of the first start | Engine's answers after it |",
            "| --- | --- | --- | ---: | ---: | ---: | --- |"]
    for path, d in restart_records(bench_dir):
        h = d["handback"]
        if "standby_takeover_s" not in h:
            continue
        record, dev = restart_record_cells(path, d, bench_dir, link_prefix)
        took, share = standby_cells(h)
        rows.append(f"| {record} | {dev} "
                    f"| `{transport_of(path, d)}` | {h['standby_rss_mib']:.0f} MiB | {took} | {share} "
                    f"| {'the same' if h['standby_engine_answered_the_same'] else 'different'} |")
    return "\n".join(rows) if len(rows) > 2 else NO_RECORD


def handback_phases_table(bench_dir: Path = BENCH_DIR) -> str:
    """Where each daemon start of a restart measurement spends its time (bench/restart.py PHASES)."""
    recs = [(p, d) for p, d in restart_records(bench_dir) if d["handback"].get("restart_phases_s")]
    if not recs:
        return NO_RECORD
    names: list[str] = []
    for _, d in recs:
        names += [k for k in d["handback"]["restart_phases_s"] if k not in names]
    rows = ["| Model | Transport | Start | Total | " + " | ".join(names) + " |",
            "| --- | --- | --- | ---: |" + " ---: |" * len(names)]
    for path, d in recs:
        h = d["handback"]
        for label, key, total in (("first", "first_start_phases_s", "first_start_to_ready_s"),
                                  ("restart", "restart_phases_s", "restart_to_ready_s")):
            ph = h[key]
            rows.append(f"| {run_label(path)} | `{transport_of(path, d)}` | {label} | {fmt_seconds(h[total])} | "
                        + " | ".join(fmt_seconds(ph[n]) if ph.get(n) else "0" for n in names) + " |")
    return "\n".join(rows)


def _newest_per_transport(model: str, bench_dir: Path) -> list[tuple[Path, dict]]:
    """The newest record of ``model`` for each transport (file names start with their date)."""
    newest: dict[str, tuple[Path, dict]] = {}
    for path, d in _records("seconds", bench_dir):  # in file-name order: the newest comes last
        if run_label(path) == model:
            newest[transport_of(path, d)] = (path, d)
    return [newest[t] for t in sorted(newest)]


def transports_table(bench_dir: Path = BENCH_DIR, link_prefix: str = "benchmarks/") -> str:
    """docs/gpu-transports.md: one llama-8b handoff per transport, with its samples and its record."""
    rows = ["| Transport | Sampling | Disk | `zero_copy` | `zero_copy` samples | `copy` | Disk / `zero_copy` | Record |",
            "| --- | --- | ---: | ---: | ---: | ---: | ---: | --- |"]
    for path, d in _newest_per_transport("llama-8b", bench_dir):
        s = d["seconds"]
        samples = ", ".join(fmt_seconds(x) for x in d["samples"]["zero_copy"])
        e = d["environment"]
        rows.append(f"| `{transport_of(path, d)}` | {sampling_label(d)} | {fmt_seconds(s['disk'])} "
                    f"| {fmt_seconds(s['zero_copy'])} | {samples} | {fmt_seconds(s['copy'])} | {fmt_ratio(speedup(d))} "
                    f"| [{path.name}]({link_prefix}{path.name}): {e.get('gpu', e['device'])}, driver "
                    f"{e.get('driver', '')}, torch {e['torch']}, {d['repeat']} samples |")
    return "\n".join(rows)


def transports_phases(bench_dir: Path = BENCH_DIR) -> str:
    """docs/gpu-transports.md: where each transport's llama-8b zero_copy handoff spends its time."""
    recs = [(p, d) for p, d in _newest_per_transport("llama-8b", bench_dir) if d.get("zero_copy_phases_ms")]
    names: list[str] = []
    for _, d in recs:
        names += [k for k in d["zero_copy_phases_ms"] if k not in names]
    rows = ["| Transport | " + " | ".join(names) + " |", "| --- |" + " ---: |" * len(names)]
    for path, d in recs:
        ph = d["zero_copy_phases_ms"]
        rows.append(f"| `{transport_of(path, d)}` | "
                    + " | ".join(fmt_seconds(ph[n] / 1e3) if n in ph else "" for n in names) + " |")
    return "\n".join(rows)


def runs_table(bench_dir: Path = BENCH_DIR, link_prefix: str = "benchmarks/") -> str:
    """Where and with what each record was measured."""
    rows = ["| Record | Date (UTC) | Commit | GPU | Driver | torch | CUDA | Python | Samples |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | ---: |"]
    for path, d in bench_records(bench_dir):
        e = d["environment"]
        rows.append(
            f"| [{path.name}]({link_prefix}{path.name}) | {e['date'].replace('T', ' ').replace('+00:00', '')} "
            f"| {commit_cell(d)} | {e.get('gpu', e['device'])} | {e.get('driver', '')} | {e['torch']} | {e.get('cuda', '')} "
            f"| {e['python']} | {d['repeat']} |")
    return "\n".join(rows)


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
        failed = ", ".join(dict.fromkeys(f"`{m.group(1)}`" for m in re.finditer(r"^(?:FAILED|ERROR) (tests/\S+)", text,
                                                                               re.MULTILINE)))
        rows.append(f"| [{log.name}]({link_prefix}{log.name}) | `{found[-1].strip()}` | {failed or 'none'} |")
    return "\n".join(rows)


# -- the SVG ---------------------------------------------------------------------------------------


# Width of a character of the chart's 12-px sans-serif text, rounded up (labels are sized with it).
CHAR_W = 7.0


def _sub_label(path: Path, d: dict) -> str:
    m = d["model"]
    return f"{m['tensors']:,} tensors, {fmt_bytes(m['bytes'])}, {transport_of(path, d)}"


def render_svg(bench_dir: Path = BENCH_DIR) -> str:
    """Grouped horizontal bars, one group per fresh-process bench record (the in-process ones are
    not restarts), on a log time axis."""
    recs = fresh_records(bench_dir) or bench_records(bench_dir)
    values = [d["seconds"][k] for _, d in recs for k, _, _ in SOURCES]
    lo = 10 ** math.floor(math.log10(min(values)))
    hi = 10 ** math.ceil(math.log10(max(values)))
    decades = round(math.log10(hi / lo))
    # The labels left of the bars are right-aligned at label_w - 8: wide enough for the longest.
    longest = max(len(_sub_label(p, d)) for p, d in recs)
    label_w, plot_w, right = max(250, math.ceil(CHAR_W * longest) + 16), 450, 70
    width = label_w + plot_w + right
    bar_h, bar_gap, group_gap, top = 16, 3, 20, 64
    group_h = len(SOURCES) * (bar_h + bar_gap) - bar_gap
    height = top + len(recs) * (group_h + group_gap) + 36

    def x(v: float) -> float:
        return label_w + plot_w * math.log10(v / lo) / decades

    gpu = {d["environment"].get("gpu", d["environment"]["device"]) for _, d in recs}
    dates = sorted({d["environment"]["date"][:10] for _, d in recs})
    how = "each sample a fresh process, as an engine restart" if all(fresh(d) for _, d in recs) \
        else "samples repeated in one process"
    title = f"Weights ready: {', '.join(sorted(gpu))}, {', '.join(dates)}, {how} (median, log scale)"
    width = max(width, math.ceil(CHAR_W * 1.2 * len(title)) + 20)  # the title is 14 px
    out = [
        (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
         f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="12">'),
        f"<title>{escape(title)}</title>",
        f'<rect width="{width}" height="{height}" fill="#ffffff"/>',
        (f'<text x="{width / 2:.1f}" y="20" text-anchor="middle" font-size="14" font-weight="bold">'
         f"{escape(title)}</text>"),
    ]
    lx = label_w
    for _key, name, color in SOURCES:
        out.append(f'<rect x="{lx}" y="32" width="12" height="12" fill="{color}"/>')
        out.append(f'<text x="{lx + 16}" y="42">{escape(name)}</text>')
        lx += 16 + 7 * len(name) + 24
    axis_y = height - 30
    for i in range(decades + 1):
        v = lo * 10**i
        gx = x(v)
        out.append(f'<line x1="{gx:.1f}" y1="{top - 6}" x2="{gx:.1f}" y2="{axis_y}" stroke="#d0d0d0"/>')
        out.append(f'<text x="{gx:.1f}" y="{axis_y + 16}" text-anchor="middle">{escape(fmt_tick(v))}</text>')
    y = top
    for path, d in recs:
        out.append(f'<text x="{label_w - 8}" y="{y + group_h / 2 - 2:.1f}" text-anchor="end" '
                   f'font-weight="bold">{escape(run_label(path))}</text>')
        out.append(f'<text x="{label_w - 8}" y="{y + group_h / 2 + 13:.1f}" text-anchor="end" fill="#555555">'
                   f"{escape(_sub_label(path, d))}</text>")
        for key, _name, color in SOURCES:
            v = d["seconds"][key]
            out.append(f'<rect x="{label_w}" y="{y}" width="{x(v) - label_w:.1f}" height="{bar_h}" fill="{color}"/>')
            out.append(f'<text x="{x(v) + 4:.1f}" y="{y + bar_h - 4}">{escape(fmt_seconds(v))}</text>')
            y += bar_h + bar_gap
        y += group_gap - bar_gap
    out.append(f'<line x1="{label_w}" y1="{axis_y}" x2="{label_w + plot_w}" y2="{axis_y}" stroke="#333333"/>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="exit 1 if the committed SVG differs from a fresh render")
    args = p.parse_args(argv)
    svg = render_svg()
    if args.check:
        if not SVG_PATH.exists() or SVG_PATH.read_text(encoding="utf-8") != svg:
            print(f"{SVG_PATH.relative_to(ROOT)} is stale: run python tools/plot_bench.py", file=sys.stderr)
            return 1
        print(f"{SVG_PATH.relative_to(ROOT)} is current")
        return 0
    SVG_PATH.write_text(svg, encoding="utf-8")
    print(f"wrote {SVG_PATH.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
