"""The guide's table of `wcache bench --seed` records (docs/benchmarks/*seed*.json, holding
``seed_gb_per_s``): weight seeding against a raw TCP copy of the same bytes, one replica against a
fan-out round, against a disk start, and the bytes the source sent. Registered in
tools/doc_tables.py; tests/docs/test_tables.py checks the region against a fresh render."""

from __future__ import annotations

from pathlib import Path

from bench_records import BENCH_DIR, NO_RECORD, fmt_bytes, fmt_ratio, fmt_seconds, records


def seed_records(bench_dir: Path = BENCH_DIR) -> list[tuple[Path, dict]]:
    return records("seed_gb_per_s", bench_dir)


def _fan(d: dict) -> int | None:
    """The record's fan-out round size, or None where it ran none (`--seed-replicas 0`: one GPU)."""
    return next((int(k.split("_")[1]) for k in d if k.startswith("fanout_") and k.endswith("_s") and k[7:-2].isdigit()),
                None)


def _fan_cells(d: dict, n: int | None) -> str:
    if n is None:
        return "| no round | | | | |"
    floor = d.get(f"fanout_{n}_cpu_floor_vs_single")
    return (f"| {n} | {fmt_seconds(d[f'fanout_{n}_s'])} | {fmt_ratio(d[f'fanout_{n}_vs_single'])} "
            f"| {'not recorded' if floor is None else fmt_ratio(floor)} "
            f"| {d[f'source_bytes_sent_{n}_vs_model']:.2f}x the arena |")


def seed_table(bench_dir: Path = BENCH_DIR, link_prefix: str = "benchmarks/") -> str:
    rows = ["| Record | Device | Host load (1 min, before and after) | Arena | Seeding | Raw TCP, fresh memory | Raw TCP, touched memory | Seeding over raw "
            "| One replica, spawn to READY | Disk start | N | N replicas at once | N over one | N's CPU over the cores, over one | Source sent for N |",
            "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for path, d in seed_records(bench_dir):
        n = _fan(d)
        device = d.get("gpu") or f"CPU ({d['cpu_count']} cores)"
        load = " to ".join(f"{v:.1f}" for v in d["load_avg_1m"]) if "load_avg_1m" in d else "not recorded"
        rows.append(f"| [{path.stem}]({link_prefix}{path.name}) | {device} | {load} | {fmt_bytes(d['model_bytes'])} "
                    f"| {d['seed_gb_per_s']:.2f} GB/s | {d['raw_tcp_gb_per_s']:.2f} GB/s "
                    f"| {d['raw_tcp_touched_gb_per_s']:.2f} GB/s | {d['seed_vs_raw_tcp']:.0%} "
                    f"| {fmt_seconds(d['single_s'])} | {fmt_seconds(d['disk_s'])} {_fan_cells(d, n)}")
    return "\n".join(rows) if len(rows) > 2 else NO_RECORD
