"""The Markdown tables of ``wcache bench --json`` records (a ``seconds`` key) in the guide: the
restart table, the key's cost, the steps, the targets, the engine start, the daemon restart and the
standby, the transports, and the table of runs (date, GPU, driver, torch of each). tools/doc_tables.py
writes them between ``<!-- generated: NAME -->`` and ``<!-- end generated -->`` in the pages."""

from __future__ import annotations

from pathlib import Path

from bench_records import (BENCH_DIR, NO_RECORD, bench_records, commit_cell, fmt_bytes, fmt_ratio, fmt_seconds,
                           fresh_records, older_records, records, run_label, sampling_label, transport_of)


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
    for path, d in records("seconds", bench_dir):  # in file-name order: the newest comes last
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
