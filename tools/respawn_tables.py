"""The guide's tables of `wcache bench --respawn` records (docs/benchmarks/*.json holding a
``respawn`` key): a killed worker against a fresh start, and the spare's memory. Registered in
tools/doc_tables.py; tests/docs/test_tables.py checks every region against a fresh render."""

from __future__ import annotations

import json
from pathlib import Path

from bench_records import BENCH_DIR, NO_RECORD, fmt_bytes, fmt_ratio, fmt_seconds, run_label


def respawn_records(bench_dir: Path = BENCH_DIR) -> list[tuple[Path, dict]]:
    out = []
    for path in sorted(bench_dir.glob("*.json")):
        data = json.loads(path.read_text(encoding="utf-8"))
        if "respawn" in data:
            out.append((path, data))
    return out


def _device(d: dict) -> str:
    e = d["environment"]
    return e.get("gpu") or f"CPU ({e['cpu_count']} cores)"


def model_label(path: Path) -> str:
    """The preset the record timed, as `wcache make-checkpoint --preset` names it, from the record's file
    name (``2026-12-04-h200-llama-8b-respawn.json`` -> ``llama-8b``). The record's own ``model.name`` is
    the checkpoint's directory, which a run may call anything (tools/gpu_run.sh makes it in /tmp/l8)."""
    return run_label(path)


def respawn_table(bench_dir: Path = BENCH_DIR, link_prefix: str = "benchmarks/") -> str:
    """Per record: the medians of a killed worker to the next 200, the supervisor's death to ready,
    a fresh `wcache serve` to its first 200 (disk and ipc_cache), the ratio, and what clients lost."""
    rows = ["| Record | Device | Model | Transport | Killed worker to next 200 | Death to ready (supervisor) "
            "| One answer before the kill | Fresh serve from disk to first 200 | Disk over respawn "
            "| Fresh serve, ipc_cache | Kills | Failed requests | Refused |",
            "| --- | --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for path, d in respawn_records(bench_dir):
        m = d["median_s"]
        rows.append(f"| [{path.stem}]({link_prefix}{path.name}) | {_device(d)} | `{model_label(path)}` "
                    f"| `{d['transport']}` | {fmt_seconds(m['death_to_next_200'])} "
                    f"| {fmt_seconds(m['worker_death_to_ready'])} | {fmt_seconds(m['answer_before_kill'])} "
                    f"| {fmt_seconds(m['restart_from_disk'])} "
                    f"| {fmt_ratio(d['ratios']['restart_from_disk_over_respawn'])} "
                    f"| {fmt_seconds(m['restart_ipc_cache'])} | {len(d['respawn']['kills'])} "
                    f"| {d['failed_requests']} | {d['refused_connections']} |")
    return "\n".join(rows) if len(rows) > 2 else NO_RECORD


def respawn_memory(bench_dir: Path = BENCH_DIR, link_prefix: str = "benchmarks/") -> str:
    """The resident memory of the idle spare and its device reserve (what the serving worker's memory
    plan leaves it), beside the serving worker's and the supervisor's resident memory."""
    rows = ["| Record | Device | Model | Spare worker (idle) | Spare reserve (device) | Serving worker | Supervisor |",
            "| --- | --- | --- | ---: | ---: | ---: | ---: |"]
    for path, d in respawn_records(bench_dir):
        mem = d["respawn"]["memory"]
        # Records before the hot spare (issue 34 step 4) have no reserve: their spare was cold.
        reserve = mem.get("spare_reserve_bytes")
        reserve = "cold spare" if reserve is None else fmt_bytes(reserve)
        rows.append(f"| [{path.stem}]({link_prefix}{path.name}) | {_device(d)} | `{model_label(path)}` "
                    f"| {fmt_bytes(mem['spare_rss_bytes'])} | {reserve} "
                    f"| {fmt_bytes(mem['serving_rss_bytes'])} | {fmt_bytes(mem['supervisor_rss_bytes'])} |")
    return "\n".join(rows) if len(rows) > 2 else NO_RECORD


def respawn_phases(bench_dir: Path = BENCH_DIR, link_prefix: str = "benchmarks/") -> str:
    """Per record that has them: the median kill's phases (bench_respawn.PHASES), which add up to
    its kill to the next 200, and the supervisor's resident memory."""
    names = ["death_seen", "promote", "order_delivery", "worker_start", "first_answer"]
    rows = ["| Record | Device | Model | Kills | Kill to next 200 (median kill) | Death seen | Promote "
            "| Order delivery | Worker start | First answer | Supervisor |",
            "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for path, d in respawn_records(bench_dir):
        p = d.get("median_kill_phases_s")
        if p is None:
            continue  # a record from before the phases were measured
        rows.append(f"| [{path.stem}]({link_prefix}{path.name}) | {_device(d)} | `{d['model']['name']}` "
                    f"| {len(d['respawn']['kills'])} | {fmt_seconds(sum(p.values()))} | "
                    + " | ".join(fmt_seconds(p[n]) for n in names)
                    + f" | {fmt_bytes(d['respawn']['memory']['supervisor_rss_bytes'])} |")
    return "\n".join(rows) if len(rows) > 2 else NO_RECORD
