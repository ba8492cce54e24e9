"""Generated regions of the guide: tables rendered from the code and from published measurements.

A page marks a region it does not write by hand with two HTML comments (invisible on the site)::

    <!-- generated: preload-flags -->
    ...what GENERATORS["preload-flags"]() returns...
    <!-- end generated -->

``python tools/doc_tables.py`` rewrites every region of every page (and the benchmark SVG);
``python tools/doc_tables.py --check`` exits 1 naming each stale one. ``tests/docs/test_tables.py``
runs the check, so a table can only change together with the code or the JSON it comes from.

Generators: ``preload-flags`` and ``serve-flags`` (every option of ``wcache preload`` / ``wcache
serve``, from ``wcache.cli.build_parser()``), ``checkpoint-refusals`` (every refused config.json
field, from ``wcache.core.llama_config.REFUSED``), the HTTP API's ``serve-endpoints``,
``serve-fields``, ``chat-fields``, ``serve-refusals`` and ``http-limits`` (``wcache.engine.api_server.server`` /
``openai_api`` / ``chat`` / ``http_front``), ``engine-metrics`` and ``daemon-metrics`` (every metric
family of each ``GET /metrics``, from ``wcache.engine.api_server.metrics`` / ``wcache.daemon.metrics``) and the
benchmark tables of ``tools/bench_tables.py``, ``tools/matrix_tables.py`` and ``tools/gpu_logs.py``.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_records
import bench_tables
import gpu_logs
import headline
import matrix_tables
import plot_bench
import respawn_tables
import seed_tables

REGION = re.compile(r"(?P<open><!-- generated: (?P<name>[\w-]+) -->\n)(?P<body>.*?)(?P<close><!-- end generated -->)",
                    re.DOTALL)

# argparse group titles -> the headings the table uses
GROUP_TITLES = {
    "options": "Model and engine",
    "parallelism": "Parallelism",
    "weight cache daemon": "Weight cache daemon",
    "autotune seeding (see docs/autotune.md)": "Autotune seeding",
    "HTTP server and shutdown": "HTTP server and shutdown",
}
NOT_SET = "not set"
REQUIRED = "required"

# Spans of help text shown as code: environment variables (with a path), flags, JSON objects.
_CODE = re.compile(r"(\$[A-Z_][A-Z0-9_]*(?:/[\w<>.-]+)?|(?<![\w`])--[a-z][\w-]*|\{\"[^}]*\})")


def command_parser(command: str) -> argparse.ArgumentParser:
    """The argparse parser of one ``wcache`` subcommand (``preload``, ``serve``)."""
    from wcache.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[command]


def preload_parser() -> argparse.ArgumentParser:
    return command_parser("preload")


def command_actions(command: str) -> list[argparse.Action]:
    """Every option of ``wcache COMMAND`` except --help, in the order argparse lists them."""
    return [a for a in command_parser(command)._actions
            if a.option_strings and not isinstance(a, argparse._HelpAction)]


def preload_actions() -> list[argparse.Action]:
    return command_actions("preload")


def option_names(action: argparse.Action) -> list[str]:
    """Long forms first, then short ones, as they are shown in the table."""
    return sorted(action.option_strings, key=lambda s: (not s.startswith("--"), action.option_strings.index(s)))


def default_cell(action: argparse.Action) -> str:
    if action.required:
        return REQUIRED
    if action.default is None:
        return NOT_SET
    if isinstance(action.default, bool):
        return "on" if action.default else "off"
    return f"`{action.default}`"


def value_cell(action: argparse.Action) -> str:
    if isinstance(action, argparse.BooleanOptionalAction) or action.nargs == 0:
        return "switch"
    if action.choices:
        return ", ".join(f"`{c}`" for c in action.choices)
    return f"`{action.metavar or action.dest.upper()}`"


def help_cell(text: str | None) -> str:
    text = (text or "").replace("|", "\\|")
    return _CODE.sub(lambda m: f"`{m.group(1)}`", text)


def unformat_help(cell: str) -> str:
    """The argparse help a description cell was rendered from."""
    return cell.replace("`", "").replace("\\|", "|")


def flags_table(command: str) -> str:
    """One table per argparse group: flag, value, default, description (the help text)."""
    parser = command_parser(command)
    out: list[str] = []
    for group in parser._action_groups:
        # Positionals (serve's model directory) are in the page's usage line, not a flag table.
        actions = [a for a in group._group_actions if a.option_strings and not isinstance(a, argparse._HelpAction)]
        if not actions:
            continue
        title = GROUP_TITLES.get(group.title, (group.title or "").capitalize())
        if out:
            out.append("")
        out += [f"### {title}", "", "| Flag | Value | Default | Description |", "| --- | --- | --- | --- |"]
        for a in actions:
            names = ", ".join(f"`{n}`" for n in option_names(a))
            out.append(f"| {names} | {value_cell(a)} | {default_cell(a)} | {help_cell(a.help)} |")
    return "\n".join(out)


def preload_flags() -> str:
    return flags_table("preload")


def serve_flags() -> str:
    return flags_table("serve")


def checkpoint_refusals() -> str:
    """Every refused config.json field: when, and the message the code gives for its example
    (wcache.core.llama_config.REFUSED, run through the engine's own check)."""
    from wcache.core.llama_config import REFUSED, example, refusal

    out = ["| Field | Refused when | Message (for the example value) |", "| --- | --- | --- |"]
    for field, (when, _) in REFUSED.items():
        text = refusal(example(field), "model/config.json").replace("|", "\\|")
        out.append(f"| `{field}` | {when} | `{text}` |")
    return "\n".join(out)


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _code(text: str) -> str:
    """``text`` as a code span in a table cell; a message that quotes with backticks gets a double fence."""
    fence = "``" if "`" in text else "`"
    return f"{fence}{_cell(text)}{fence}"


def serve_endpoints() -> str:
    """Every route of the engine's HTTP API (wcache.engine.api_server.server.ROUTES)."""
    from wcache.engine.api_server.server import ROUTES

    out = ["| Request | Answer |", "| --- | --- |"]
    out += [f"| `{method} {path}` | {_cell(answer)} |" for (method, path), answer in ROUTES.items()]
    return "\n".join(out)


def serve_fields() -> str:
    """Every field of a completion request, supported or refused (wcache.engine.openai.openai_api.COMPLETION_FIELDS)."""
    from wcache.engine.openai.openai_api import COMPLETION_FIELDS

    return fields_table(COMPLETION_FIELDS)


def chat_fields() -> str:
    """Every field of a chat request, supported or refused (wcache.engine.openai.chat.CHAT_FIELDS)."""
    from wcache.engine.openai.chat import CHAT_FIELDS

    return fields_table(CHAT_FIELDS)


def fields_table(table: dict) -> str:
    import json

    out = ["| Field | Served | Value, or why it is refused |", "| --- | --- | --- |"]
    for name, f in table.items():
        if f.supported:
            out.append(f"| `{name}` | yes | {_cell(f.what)} |")
        else:
            neutral = " or ".join(f"`{json.dumps(v)}`" for v in f.neutral)
            out.append(f"| `{name}` | refused unless {neutral} | {_cell(f.what)} |")
    return "\n".join(out)


def serve_refusals() -> str:
    """Every refusal of the HTTP API: status, vLLM's error type, message (wcache.engine.api_server.server.REFUSALS)."""
    from wcache.engine.openai.openai_api import error_type
    from wcache.engine.api_server.server import REFUSALS

    out = ["| Status | `type` | Message | When |", "| --- | --- | --- | --- |"]
    out += [f"| {status} | `{error_type(status)}` | {_code(message)} | {_cell(when)} |"
            for status, message, when in REFUSALS]
    return "\n".join(out)


def http_limits() -> str:
    """The HTTP front door's limits with their defaults (wcache.engine.api_server.http_front.Limits)."""
    from dataclasses import fields

    from wcache.engine.api_server.http_front import DEFAULT_LIMITS, LIMIT_DOCS

    out = ["| Limit | Default | What it bounds |", "| --- | --- | --- |"]
    for f in fields(DEFAULT_LIMITS):
        value = getattr(DEFAULT_LIMITS, f.name)
        shown = f"{value:g} s" if f.name.endswith("_s") else str(value)
        out.append(f"| `{f.name}` | {shown} | {_cell(LIMIT_DOCS[f.name])} |")
    return "\n".join(out)


def streaming_records(bench_dir: Path = bench_records.BENCH_DIR) -> list[tuple[Path, dict]]:
    """``python -m wcache.bench.streaming`` records (concurrent streaming clients), oldest first."""
    from wcache.bench.streaming import RECORD_KEY

    return sorted(bench_records.records(RECORD_KEY, bench_dir), key=lambda r: (r[1]["date"], r[0].name))


def _record_link(path: Path, d: dict, link_prefix: str) -> str:
    """The record's date, and its commit where it names one (a day can have several records)."""
    commit = f" `{d['commit']}`" if d.get("commit") else ""
    return f"[{d['date'][:10]}{commit}]({link_prefix}{path.name})"


def http_streaming(bench_dir: Path = bench_records.BENCH_DIR, link_prefix: str = "benchmarks/") -> str:
    """docs/benchmarks.md's streaming table: one row per published record."""
    rows = ["| Clients | Tokens each | Complete | Refused | First token p50 | First token p99 | Request p99 | "
            "All done | Machine | Record |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for path, d in streaming_records(bench_dir):
        t, r = d["ttft_s"], d["request_s"]
        where = d.get("gpu") or f"{d.get('cpu_model', d['machine'])}, {d['cpu_count']} CPUs"
        machine = f"{where}, torch {d['torch']}"
        rows.append(f"| {d['streaming_clients']} | {d['max_tokens']} | {d['completed']} | {d['refused']} | "
                    f"{t['p50']:.2f} s | {t['p99']:.2f} s | {r['p99']:.2f} s | {d['wall_s']:.2f} s | {machine} | "
                    f"{_record_link(path, d, link_prefix)} |")
    return "\n".join(rows)


def http_vs_one(bench_dir: Path = bench_records.BENCH_DIR, link_prefix: str = "benchmarks/") -> str:
    """docs/benchmarks.md's table of the records made with ``--vs-one``: N clients against one."""
    rows = ["| Device | Model | Clients | Tokens each | One client, tokens/s (decode) | All, tokens/s (decode) | "
            "Ratio (decode) | First token p99 ratio | Texts as alone | Engine step = forward + overhead | Record |",
            "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- |"]
    for path, d in streaming_records(bench_dir):
        if not d.get("vs_one"):
            continue
        one, v, st = d["one_client"], d["vs_one"], d["engine_steps"] or {}
        device = d.get("gpu") or f"{d.get('cpu_model', d['machine'])}, {d['cpu_count']} CPUs"

        def decode(x: dict, key: str = "decode_tokens_per_s") -> str:
            return f" ({x[key]:,.0f})" if key in x else ""

        ratio = f" (x{v['decode_tokens_per_s']})" if "decode_tokens_per_s" in v else ""
        rows.append(f"| {device}, torch {d['torch']} | {d['model']} | {d['streaming_clients']} | {d['max_tokens']} | "
                    f"{one['tokens_per_s']:,.0f}{decode(one)} | {d['tokens_per_s']:,.0f}{decode(d)} | "
                    f"x{v['tokens_per_s']}{ratio} | "
                    f"x{v['ttft_p99']} | {d['matching_text']} of {d['streaming_clients']} | "
                    f"{st.get('step_ms', 0):.2f} = {st.get('forward_ms', 0):.2f} + {st.get('overhead_ms', 0):.2f} ms | "
                    f"{_record_link(path, d, link_prefix)} |")
    return "\n".join(rows)


def metrics_table(metrics) -> str:
    """One row per metric family a server exports: the name a scrape shows, type, labels, meaning."""
    from wcache.core.metrics import table

    out = ["| Metric | Type | Labels | What it says |", "| --- | --- | --- | --- |"]
    for name, kind, labels, what in table(metrics):
        shown = ", ".join(f"`{label}`" for label in labels.split(", ")) if labels else "none"
        out.append(f"| `{name}` | {kind} | {shown} | {_cell(what)} |")
    return "\n".join(out)


def engine_metrics() -> str:
    """Every metric of the engine's GET /metrics (wcache.engine.api_server.metrics.METRICS)."""
    from wcache.engine.api_server.metrics import METRICS

    return metrics_table(METRICS)


def daemon_metrics() -> str:
    """Every metric of the daemon's GET /metrics on its health port (wcache.daemon.metrics.METRICS)."""
    from wcache.daemon.metrics import METRICS

    return metrics_table(METRICS)


GENERATORS: dict[str, Callable[[], str]] = {
    "engine-metrics": engine_metrics,
    "daemon-metrics": daemon_metrics,
    "http-streaming": http_streaming,
    "http-vs-one": http_vs_one,
    "serve-endpoints": serve_endpoints,
    "serve-fields": serve_fields,
    "chat-fields": chat_fields,
    "serve-refusals": serve_refusals,
    "http-limits": http_limits,
    "preload-flags": preload_flags,
    "serve-flags": serve_flags,
    "checkpoint-refusals": checkpoint_refusals,
    "bench-table": bench_tables.bench_table,
    "bench-table-older": bench_tables.bench_table_older,
    "bench-keys": bench_tables.bench_keys_table,
    "bench-phases": bench_tables.phases_table,
    "bench-targets": bench_tables.targets_table,
    "bench-runs": bench_tables.runs_table,
    "bench-start": bench_tables.engine_start_table,
    "bench-handback": bench_tables.handback_table,
    "bench-handback-phases": bench_tables.handback_phases_table,
    "bench-standby": bench_tables.standby_table,
    "bench-copy-phases": bench_tables.copy_phases_table,
    "transports-handoff": bench_tables.transports_table,
    "transports-phases": bench_tables.transports_phases,
    "ns-matrix": matrix_tables.matrix_table,
    "ns-matrix-runs": matrix_tables.matrix_runs,
    "gpu-tests-summary": gpu_logs.gpu_tests_summary,
    "bench-respawn": respawn_tables.respawn_table,
    "respawn-memory": respawn_tables.respawn_memory,
    "respawn-phases": respawn_tables.respawn_phases,
    "bench-seed": seed_tables.seed_table,
    "headline": headline.headline,
    "headline-readme": headline.headline_readme,
}


def guide_pages() -> list[Path]:
    """Every page with generated regions: the guide's, and the README (its headline)."""
    return sorted(DOCS.rglob("*.md")) + [ROOT / "README.md"]


def regions(text: str) -> list[tuple[str, str]]:
    """(name, body) of every generated region of a page, body without the surrounding blank lines."""
    return [(m.group("name"), m.group("body").strip("\n")) for m in REGION.finditer(text)]


def render_page(text: str) -> str:
    """The page with every region replaced by its generator's output."""
    def sub(m: re.Match) -> str:
        name = m.group("name")
        if name not in GENERATORS:
            raise KeyError(f"unknown generated region {name!r}; known: {', '.join(GENERATORS)}")
        return f"{m.group('open')}\n{GENERATORS[name]()}\n\n{m.group('close')}"

    return REGION.sub(sub, text)


def stale(pages: list[Path] | None = None) -> list[str]:
    """Regions (page: name) whose text differs from a fresh render."""
    found = []
    for page in pages or guide_pages():
        text = page.read_text(encoding="utf-8")
        fresh = dict(regions(render_page(text)))
        for name, body in regions(text):
            if body != fresh[name]:
                shown = page.relative_to(ROOT) if page.is_relative_to(ROOT) else page
                found.append(f"{shown}: {name}")
    return found


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="exit 1 naming each region that is stale")
    args = p.parse_args(argv)
    if args.check:
        bad = stale()
        if plot_bench.SVG_PATH.read_text(encoding="utf-8") != plot_bench.render_svg():
            bad.append(str(plot_bench.SVG_PATH.relative_to(ROOT)))
        for b in bad:
            print(f"stale: {b} (run python tools/doc_tables.py)", file=sys.stderr)
        return 1 if bad else 0
    for page in guide_pages():
        text = page.read_text(encoding="utf-8")
        new = render_page(text)
        if new != text:
            page.write_text(new, encoding="utf-8")
            print(f"rewrote {page.relative_to(ROOT)}")
    return plot_bench.main([])


if __name__ == "__main__":
    sys.exit(main())
