"""The README's and the guide's home page's headline: what an engine restart costs, end to end, from
the newest records (not typed by hand). Registered in tools/doc_tables.py as ``headline`` (for
docs/index.md) and ``headline-readme`` (README.md, whose links start at the repository root);
tests/docs/test_tables.py checks both against a fresh render, like every generated region.

It says where the rest of a start goes: the weights are milliseconds, and what remains of an engine
start via the cache is Python, `import torch` and the CUDA context (the bench's floor), which only
`wcache serve --respawn` takes off a crash's path, and points to docs/restart-costs.md for what an
upstream vLLM engine still pays after its weights. It names every GPU target (tools/bench_tables.py)
its record misses, and how many samples the CPU figures are, on what kind of machine: a headline
that showed only the wins would promise more than the records hold (tests/docs/test_guide_agrees.py).
"""

from __future__ import annotations

import textwrap
from pathlib import Path

from bench_records import BENCH_DIR, fresh_records, run_label
from bench_tables import TARGETS, _target_cell, _target_value
from respawn_tables import respawn_records

GPU_RECORD = "-h200-llama-8b-vmm_fd.json"  # the headline's model and transport, on the GPU
RESPAWN_RECORD = "-h200-llama-8b-respawn.json"
CPU_RECORD_DIR = "cpu"  # the CPU bench records (docs/benchmarks/cpu/)


def _newest(records, suffix: str):
    found = [(p, d) for p, d in records if p.name.endswith(suffix)]
    return found[-1] if found else (None, None)


def _ms(s: float) -> str:
    return f"{s * 1000:.1f} ms"


def _s(s: float) -> str:
    return f"{s:.2f} s"


def _from_floor(start: dict) -> str:
    """'0.21 s above' or '0.21 s below' (the engine makes its CUDA context while it imports, so it
    can start sooner than the floor's interpreter, which pays the two one after the other)."""
    over = start["ipc_cache"]["seconds"] - start["floor"]["seconds"]
    return f"{abs(over):.2f} s {'above' if over >= 0 else 'below'}"


def missed_targets(path: Path, d: dict) -> list[str]:
    """The GPU targets (tools/bench_tables.py) that this record misses, each with its figure and goal:
    a headline that shows only what was met would promise more than the record holds."""
    out = []
    for label, model, what, goal, higher in TARGETS:
        v = _target_value(d, what) if model == run_label(path) else None
        if v is not None and not (v >= goal if higher else v <= goal):
            out.append(f"{label} ({_target_cell(what, v)}; goal {'>=' if higher else '<='} {_target_cell(what, goal)})")
    return out


def headline(bench_dir: Path = BENCH_DIR, link_prefix: str = "benchmarks/") -> str:
    path, d = _newest(fresh_records(bench_dir), GPU_RECORD)
    rpath, r = _newest(respawn_records(bench_dir), RESPAWN_RECORD)
    cpu = fresh_records(bench_dir / CPU_RECORD_DIR)
    if d is None:
        return "No GPU record yet: see the benchmarks page."
    page = link_prefix[: -len("benchmarks/")]  # the guide's pages, from where the headline stands
    env, sec, start, hb = d["environment"], d["seconds"], d["engine_start"], d.get("handback", {})
    rows = [
        "| Measured in fresh processes | From disk | Via the cache |",
        "| --- | ---: | ---: |",
        f"| Weights ready in a new engine | {_s(sec['disk'])} | {_ms(sec['zero_copy'])} (`zero_copy`) |",
        f"| Engine start to `/health` 200 | {_s(start['disk']['seconds'])} | {_s(start['ipc_cache']['seconds'])} |",
        f"| The floor: a bare interpreter that imports torch, then makes a CUDA context | | {_s(start['floor']['seconds'])} |",
    ]
    if hb.get("adopted"):
        rows.append(f"| Daemon restart to READY (it takes the weights back from a running engine) | "
                    f"{_s(hb['first_start_to_ready_s'])} (first start) | {_s(hb['restart_to_ready_s'])} |")
    if hb.get("standby_adopted"):
        rows.append(f"| The same, with a standby daemon waiting (`--weight-cache-standby`): kill to READY | | "
                    f"{_s(hb['standby_takeover_s'])} |")
    if r is not None:
        kill = r["median_s"]["death_to_next_200"]
        rows.append(f"| A killed engine answering again, under `wcache serve --respawn` | "
                    f"{_s(r['median_s']['restart_from_disk'])} (a fresh start) | {_s(kill)} |")
    out = [
        f"On one {env['gpu']} with the `llama-8b` test checkpoint "
        f"({d['model']['bytes'] / 2**30:.1f} GiB, `{d['transport']}`; driver {env['driver']}, torch {env['torch']}, "
        f"{env['date'][:10]}, commit `{env.get('commit', 'not recorded')}`):",
        "",
        *rows,
        "",
        f"So the cache makes the weights free, and a restarted engine is then {_from_floor(start)} the floor "
        "of a bare interpreter with torch and a CUDA context: the rest of its start is Python and CUDA, which "
        "only `--respawn` (a spare worker, imported in advance) takes off a crash's path. A vLLM engine pays "
        "more after its weights (torch.compile, CUDA graphs, kernel autotuning): "
        f"[What a restart still costs]({page}restart-costs.md) lists each phase with its published figures.",
    ]
    missed = missed_targets(path, d)
    if missed:
        out += ["", f"This record misses {len(missed)} of the [GPU targets]({page}benchmarks.md#against-the-gpu-targets): "
                + "; ".join(missed) + "."]
    if cpu:
        cp, c = cpu[-1]
        ce = c["engine_start"]
        n = len(ce["ipc_cache"]["samples"])
        out += ["", f"On a CPU (the `small` preset, {c['environment']['cpu_count']} cores, "
                    f"{c['environment']['date'][:10]}), an engine starts from disk in {_s(ce['disk']['seconds'])} "
                    f"and via the cache in {_s(ce['ipc_cache']['seconds'])}: "
                    f"{'one sample' if n == 1 else f'the median of {n} samples'} of each, on a machine shared "
                    "with other work, so read them as an example, not a measurement to compare."]
    links = [f"[{p.name}]({link_prefix}{p.relative_to(bench_dir).as_posix()})"
             for p in (path, rpath, cpu[-1][0] if cpu else None) if p is not None]
    out += ["", "Records: " + ", ".join(links) + "."]
    # Prose wrapped to the guide's 120 columns (markdownlint); table rows stay whole.
    return "\n".join(line if line.startswith("|") else textwrap.fill(line, 100, break_long_words=False,
                                                                      break_on_hyphens=False)
                     for line in out)


def headline_readme() -> str:
    return headline(link_prefix="docs/benchmarks/")
