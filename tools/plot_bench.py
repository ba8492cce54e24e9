"""Render the published weights-ready measurements as an SVG bar chart,
``docs/benchmarks/restart-h200.svg``, from the ``wcache bench --json`` records in docs/benchmarks/.

Every figure the guide shows about a GPU run comes from a JSON record in ``docs/benchmarks/``, never
typed by hand: through this module (the chart), tools/bench_tables.py (the bench's tables),
tools/matrix_tables.py (the namespace/user matrix of ``tools/ns_matrix.py --json`` records) and
tools/gpu_logs.py (the GPU test logs' pytest summary lines and failures); tools/bench_records.py
reads the records and formats their figures for all of them. ``tools/doc_tables.py`` rewrites or
checks the tables between ``<!-- generated: NAME -->`` and ``<!-- end generated -->`` comments in
the pages, and ``tests/docs/test_tables.py`` fails when a page or the SVG differs from what these
modules render from the JSON.

    python tools/plot_bench.py            # rewrite the SVG
    python tools/plot_bench.py --check    # exit 1 if the committed SVG is stale

No plotting library: the SVG is written by hand, deterministically (fixed number formats, files in
name order), so regenerating it from the same JSON gives the same bytes.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from xml.sax.saxutils import escape

from bench_records import (BENCH_DIR, ROOT, bench_records, fmt_bytes, fmt_seconds, fmt_tick, fresh, fresh_records,
                           run_label, transport_of)

SVG_PATH = BENCH_DIR / "restart-h200.svg"

SOURCES = (("disk", "disk (warm page cache)", "#8d8d8d"),
           ("zero_copy", "ipc_cache zero_copy", "#1e6fd9"),
           ("copy", "ipc_cache copy", "#2e9d4f"))


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
