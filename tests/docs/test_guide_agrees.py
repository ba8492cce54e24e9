"""The guide agrees with the code and with itself ([truth-3]): each test here guards a contradiction a
reader found once, so that it cannot come back.

* Every logger a log line of the guide shows (``[wcache...]``) is one the code creates, so a filter
  copied from the guide matches.
* No page says "small test model": the examples use the ``tiny`` preset, and a ``small`` preset exists.
* The respawn tables name the model as ``wcache make-checkpoint --preset`` does.
* The headline names every GPU target its record misses, and says how many samples its CPU figures are.
* In GPU mode (``WCACHE_RUN_GPU_BLOCKS=1``) every ``--model DIR`` a page runs is made by an earlier
  block of that page.
* benchmarks.md's explanation of the CPU respawn record (a fresh ``ipc_cache`` start no faster than one
  from disk: noise, not a cost of the cache) holds for every CPU respawn record published.
"""

from __future__ import annotations

import ast
import json
import re
import statistics
from pathlib import Path

import pytest
from tools.docs_runner.coverage import RUN, SUBSTITUTED, disposition
from tools.docs_runner.parse import doc_pages, extract_blocks

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
PACKAGE = ROOT / "reference_impl" / "wcache"
GUIDE = sorted(DOCS.glob("*.md")) + [ROOT / "README.md"]

# A log line as wcache's logs.FORMAT writes it: LEVEL MM-DD HH:MM:SS [logger] message.
LOG_LINE = re.compile(r"^(?:DEBUG|INFO|WARNING|ERROR|CRITICAL) \d\d-\d\d \d\d:\d\d:\d\d \[(wcache[\w.]*)\]", re.MULTILINE)
# A logger named in prose: `[wcache.x]` in backticks.
NAMED = re.compile(r"`\[(wcache[\w.]*)\]`")


def code_loggers() -> set[str]:
    """Every name passed as a string to ``logging.getLogger(...)`` in the package."""
    names = set()
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "getLogger"
                    and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
                names.add(node.args[0].value)
    return names


def guide_loggers() -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for page in GUIDE:
        text = page.read_text(encoding="utf-8")
        for pattern in (LOG_LINE, NAMED):
            for m in pattern.finditer(text):
                line = text.count("\n", 0, m.start()) + 1
                found.setdefault(m.group(1), []).append(f"{page.relative_to(ROOT)}:{line}")
    return found


def test_code_loggers_are_found():
    # The parser must see the loggers that the guide names most, or the next test proves nothing.
    assert {"wcache.preload", "wcache.daemon", "wcache.engine.loader", "wcache.autotune", "wcache.cli"} <= code_loggers()


def test_every_logger_in_the_guide_is_one_the_code_creates():
    loggers = code_loggers()
    shown = guide_loggers()
    assert shown, "no [wcache...] logger found in the guide: the patterns are stale"
    wrong = {name: where for name, where in shown.items() if name not in loggers}
    assert not wrong, f"the guide shows loggers the code never creates (it has {sorted(loggers)}): {wrong}"


def test_no_page_calls_a_preset_the_small_test_model():
    bad = [f"{p.relative_to(ROOT)}:{i}" for p in GUIDE
           for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1)
           if re.search(r"\bsmall test model\b", line, re.IGNORECASE)]
    assert not bad, f"'small test model' is ambiguous beside the `small` preset; name the preset (`tiny`): {bad}"


def _generated(page: str, name: str) -> str:
    text = (DOCS / page).read_text(encoding="utf-8")
    m = re.search(rf"<!-- generated: {re.escape(name)} -->\n(.*?)<!-- end generated -->", text, re.DOTALL)
    assert m, f"{page} has no generated region {name}"
    return m.group(1)


@pytest.mark.parametrize("page,region", [("benchmarks.md", "bench-respawn"), ("respawn.md", "respawn-memory")])
def test_respawn_tables_name_presets_as_the_cli_does(page, region):
    from wcache.core.checkpoint import PRESETS

    text = _generated(page, region)
    rows = [r for r in text.splitlines() if r.startswith("| [")]
    assert rows, f"{page}: the {region} table has no record rows"
    for row in rows:
        model = row.split("|")[3].strip().strip("`")
        assert model in PRESETS, f"{page}: model {model!r} is not a preset ({sorted(PRESETS)}): {row}"


def test_headline_names_each_missed_target_and_the_cpu_samples():
    import headline
    from bench_records import fresh_records

    text = headline.headline()
    path, d = headline._newest(fresh_records(), headline.GPU_RECORD)
    missed = headline.missed_targets(path, d)
    for target in missed:
        assert " ".join(target.split()) in " ".join(text.split()), f"the headline omits a missed target: {target}"
    if missed:
        assert "benchmarks.md#against-the-gpu-targets" in text
    cpu = fresh_records(headline.BENCH_DIR / headline.CPU_RECORD_DIR)
    if cpu:
        n = len(cpu[-1][1]["engine_start"]["ipc_cache"]["samples"])
        said = "one sample" if n == 1 else f"the median of {n} samples"
        assert said in text and "shared with other work" in text


def test_missed_targets_finds_a_miss():
    """missed_targets is not vacuous: a record whose handoff takes a second misses the 3 ms target."""
    import headline

    path = Path("2026-12-04-h200-llama-8b-vmm_fd.json")
    d = json.loads((DOCS / "benchmarks" / path.name).read_text(encoding="utf-8"))
    d["seconds"] = dict(d["seconds"], zero_copy=1.0)
    assert any(t.startswith("zero_copy handoff, 16 GB model (1.00 s") for t in headline.missed_targets(path, d))


MADE = re.compile(r"make-checkpoint\s+(\S+)")
USED = re.compile(r"--model[ =](\S+)")


def _dir(arg: str) -> str:
    arg = arg.strip("\"'").rstrip("/")
    return arg[2:] if arg.startswith("./") else arg


def models_not_made(page: Path) -> list[str]:
    """``--model DIR`` arguments (relative paths) that the page's blocks run in GPU mode before any of
    its blocks (or the same block, earlier) makes DIR with ``wcache make-checkpoint``."""
    made: set[str] = set()
    missing = []
    for block in extract_blocks(page):
        kind, _ = disposition(block, gpu=True)
        if block.lang != "bash" or kind not in (RUN, SUBSTITUTED):
            continue
        for m in USED.finditer(block.source):
            model = _dir(m.group(1))
            if model.startswith(("$", "/", "~")):
                continue  # a variable or an absolute path: made outside the page's working directory
            here = {_dir(x) for x in MADE.findall(block.source[:m.start()])}
            if model not in made | here:
                missing.append(f"{block.where}: --model {model}")
        made |= {_dir(x) for x in MADE.findall(block.source)}
    return missing


def test_gpu_mode_runs_no_model_that_the_page_has_not_made():
    missing = [m for page in doc_pages() for m in models_not_made(page)]
    assert not missing, ("in GPU mode these blocks use a checkpoint that no earlier block of their page "
                         f"makes ('No config.json in ...'): {missing}")


def test_models_not_made_sees_a_missing_checkpoint(tmp_path):
    page = tmp_path / "p.md"
    page.write_text("# P\n\n<!-- block: skip reason=\"GPU-only: a CUDA device\" -->\n```bash\n"
                    "wcache bench --respawn --model llama-8b --device cuda\n```\n\n```bash\n"
                    "wcache make-checkpoint tiny --preset tiny\nwcache bench --model ./tiny --device cpu\n```\n",
                    encoding="utf-8")
    assert [m.split(": ", 1)[1] for m in models_not_made(page)] == ["--model llama-8b"]


def test_the_cpu_respawn_records_noise_explanation_holds():
    """benchmarks.md says a CPU record's fresh ipc_cache start is no faster than from disk because both
    are the same imports, its samples spreading wider than the gap between the medians. A CPU record
    where the cache loses by more than its own noise would make that sentence false."""
    assert "wider than the gap between the two medians" in (DOCS / "benchmarks.md").read_text(encoding="utf-8")
    # CPU records by what they say, not by name: the Xeon one is named "-xeon-", not "-cpu-".
    cpu = [p for p in sorted((DOCS / "benchmarks").glob("*-respawn.json"))
           if json.loads(p.read_text(encoding="utf-8"))["environment"]["device"] == "cpu"]
    assert any("-xeon-" in p.name for p in cpu) and any("-cpu-" in p.name for p in cpu), cpu
    for path in cpu:
        d = json.loads(path.read_text(encoding="utf-8"))
        s = d["restart_samples_s"]
        gap = statistics.median(s["ipc_cache"]) - statistics.median(s["safetensors"])
        if gap > 0:
            spread = max(s["ipc_cache"]) - min(s["ipc_cache"])
            assert spread > gap, f"{path.name}: ipc_cache is slower by {gap:.2f} s, more than its spread {spread:.2f} s"


def test_what_a_restart_still_costs_sources_every_figure():
    """docs/restart-costs.md: each phase of an upstream restart carries a figure and its source; the
    flags and paths are named as upstream names them; the headline and Differences from vLLM link it."""
    text = (DOCS / "restart-costs.md").read_text(encoding="utf-8")
    refs = dict(re.findall(r"^\[([\w-]+)\]: (https://\S+)$", text, re.MULTILINE))
    rows = [r for r in text.splitlines() if r.startswith("| ") and not r.startswith(("| Phase", "| ---"))]
    phases = [r.split("|")[1].strip() for r in rows]
    for phase in ("Weight loading", "Dynamo bytecode transform", "Inductor compile, or its cache load",
                  "KV cache profiling", "CUDA graph capture", "Kernel autotune and JIT"):
        assert phase in phases, f"restart-costs.md lost the phase {phase!r}"
    for row in rows:
        figures = row.split("|")[3]
        cited = re.findall(r"\]\[([\w-]+)\]", figures)
        assert re.search(r"\d", figures) and cited, f"a phase without a sourced figure: {row[:80]}"
        assert all(c in refs for c in cited), f"a citation without its link: {cited}"
    for name in ("VLLM_CACHE_ROOT", "~/.cache/vllm/torch_compile_cache", "--compilation-config", "--enforce-eager",
                 "VLLM_DISABLE_COMPILE_CACHE", "github.com/vllm-project/vllm/issues/19824",
                 "github.com/vllm-project/vllm/issues/20264", "lmsys.org/blog/2026-08-21-sglang-fast-recovery"):
        assert name in text, f"restart-costs.md no longer names {name}"
    for page in ("index.md", "differences-from-vllm.md"):
        assert "restart-costs.md" in (DOCS / page).read_text(encoding="utf-8"), page
    assert "restart-costs.md" in (ROOT / "README.md").read_text(encoding="utf-8")
