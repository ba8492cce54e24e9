"""docs/gpu-transports.md quotes the H200 records in docs/benchmarks/: every figure and matrix cell is
checked here against the JSON (and the GPU test logs), so none of them is typed by hand unchecked.

* the handoff table and the phase table: rendered from the two llama-8b bench records and compared
  row by row with the page;
* every other figure in the page's prose (a number with a unit) must be one of those rendered values;
* the machine line (GPU, driver, torch, CUDA) matches both records;
* the namespace table: its cases, in order, are the ns-matrix records' cases, and each cell is
  `maps` or `fails` as the record says, for each transport;
* the GPU test results quoted are the logs' summary lines and failure;
* the messages quoted are the code's.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "gpu-transports.md"
BENCH = ROOT / "docs" / "benchmarks"
TRANSPORTS = ("cuda_ipc", "vmm_fd")
BENCH_RECORDS = {t: BENCH / f"2026-12-02-h200-llama-8b-{t}.json" for t in TRANSPORTS}
MATRIX_RECORDS = {t: BENCH / f"2026-12-02-h200-ns-matrix-{t}.json" for t in TRANSPORTS}
GPU_LOG = BENCH / "2026-12-02-h200-gpu-tests.log"
RELEASE_LOG = BENCH / "2026-12-02-h200-gpu-vmm-release-test.log"
FIGURE = re.compile(r"(?<![\w.])\d[\d,]*(?:\.\d+)?(?: ?(?:ms|µs|s|GiB|MiB|GB|MB)\b|x\b)")
PHASES = ("key", "connect", "request", "map", "bind")


def fmt_ms(ms: float) -> str:
    return f"{ms:.1f} ms" if ms >= 1 else f"{ms:.2f} ms"


def fmt_s(s: float) -> str:
    return f"{s:.2f} s" if s >= 1 else fmt_ms(s * 1e3)


def page() -> str:
    return PAGE.read_text(encoding="utf-8")


def prose(text: str) -> str:
    """The page without its fenced blocks and HTML comments."""
    text = re.sub(r"(?ms)^(```+|~~~+).*?^\1\s*$", "", text)
    return re.sub(r"(?s)<!--.*?-->", "", text)


def record(t: str) -> dict:
    return json.loads(BENCH_RECORDS[t].read_text(encoding="utf-8"))


def handoff_row(t: str) -> str:
    d = record(t)
    s, m = d["seconds"], d["model"]
    samples = ", ".join(fmt_s(x) for x in d["samples"]["zero_copy"])
    return (f"| `{t}` | {m['tensors']:,} | {m['bytes'] / 2**30:.2f} GiB | {fmt_s(s['disk'])} | {fmt_s(s['zero_copy'])} "
            f"| {samples} | {fmt_s(s['copy'])} | {d['ratios']['disk_over_zero_copy']:.1f}x |")


def phases_row(t: str) -> str:
    ph = record(t)["zero_copy_phases_ms"]
    return f"| `{t}` | " + " | ".join(fmt_ms(ph[p]) for p in PHASES) + " |"


def test_records_are_the_transports_they_are_named_after():
    # The cuda_ipc record predates the "transport" field; its map step (a legacy handle open of the
    # whole arena) is what tells it apart. The vmm_fd record names its arena kind.
    assert record("vmm_fd")["transport"] == "cuda_vmm_fd"
    assert record("cuda_ipc").get("transport", "cuda_ipc") == "cuda_ipc"
    for t in TRANSPORTS:
        assert record(t)["environment"]["device"] == "cuda" and record(t)["model"]["tensors"] == 195


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_handoff_and_phase_rows_equal_the_records(transport):
    text = page()
    assert handoff_row(transport) in text.splitlines(), handoff_row(transport)
    assert phases_row(transport) in text.splitlines(), phases_row(transport)


def test_every_figure_in_the_prose_is_a_checked_value():
    checked = set()
    for t in TRANSPORTS:
        checked |= set(FIGURE.findall(handoff_row(t) + phases_row(t)))
    text = prose(page())
    for t in TRANSPORTS:  # the checked tables themselves
        text = text.replace(handoff_row(t), "").replace(phases_row(t), "")
    found = FIGURE.findall(text)
    assert found, "the prose quotes figures; the pattern must find them"
    assert [f for f in found if f not in checked] == []


def test_machine_line_matches_both_records():
    text = " ".join(page().split())
    for t in TRANSPORTS:
        e = record(t)["environment"]
        line = f"{e['gpu']}, driver {e['driver']}, torch {e['torch']}, CUDA {e['cuda']}"
        assert line in text, line
        assert record(t)["repeat"] == 3 and "median of three samples" in text
        assert BENCH_RECORDS[t].name in text


def _matrix_rows(text: str) -> list[list[str]]:
    lines = text.splitlines()
    start = lines.index("| Case | `cuda_ipc` | `vmm_fd` | What the row says |")
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in line.strip().strip("|").split(" | ")])
    return rows


def test_namespace_table_equals_the_matrix_records():
    records = {t: json.loads(MATRIX_RECORDS[t].read_text(encoding="utf-8")) for t in TRANSPORTS}
    for t in TRANSPORTS:
        assert records[t]["meta"]["transport"] == t and MATRIX_RECORDS[t].name in page()
    rows = _matrix_rows(page())
    cases = [r["case"] for r in records["cuda_ipc"]["rows"]]
    assert cases == [r["case"] for r in records["vmm_fd"]["rows"]]
    assert [r[0] for r in rows] == cases
    for row in rows:
        for i, t in enumerate(TRANSPORTS, start=1):
            rec = next(r for r in records[t]["rows"] if r["case"] == row[0])
            assert row[i] == ("maps" if rec["maps"] else "fails"), (row, t)
    # The two failing rows are explained by what their records say, not by CUDA.
    failed = {r["case"]: r["error"] for r in records["vmm_fd"]["rows"] if not r["maps"]}
    for case, error in failed.items():
        note = next(r[3] for r in rows if r[0] == case)
        if "Autotune pass failed" in error:
            assert "autotune result" in note and "harness" in note
        else:
            assert "is not owned by the current user" in error and "is not owned by the current user" in note


def test_gpu_test_results_are_the_logs():
    text = " ".join(page().split())
    log, release = GPU_LOG.read_text(encoding="utf-8"), RELEASE_LOG.read_text(encoding="utf-8")
    assert "1 failed, 12 passed" in log.splitlines()[-1] and "`1 failed, 12 passed`" in text
    assert re.findall(r"^FAILED (\S+)", log, re.M) == \
        ["tests/gpu/test_cuda_path.py::test_copy_mode_release_returns_the_daemons_memory[vmm_fd]"]
    assert "`test_copy_mode_release_returns_the_daemons_memory[vmm_fd]`" in text
    assert "1 passed, 12 deselected" in release.splitlines()[-1] and "`1 passed, 12 deselected`" in text
    # "passed with both transports": the test is parametrized over both, and only the copy release failed.
    src = (ROOT / "tests" / "gpu" / "test_cuda_path.py").read_text(encoding="utf-8")
    assert '@pytest.fixture(params=["cuda_ipc", "vmm_fd"])' in src
    assert "def test_zero_copy_engine_keeps_serving_after_the_daemon_is_killed(gpu," in src


def test_quoted_messages_are_the_codes():
    from wcache.wire import cuda_vmm
    from wcache import errors
    from wcache.errors import LoaderConfigError
    from wcache.engine.loading.config import parse_loader_config

    text = " ".join(page().split())
    assert errors.REASONS["transport"].format(served="cuda_ipc", wanted="vmm_fd") in text
    with pytest.raises(LoaderConfigError) as e:
        parse_loader_config({"transport": "nvlink"})
    quoted = "transport must be one of ['auto', 'cuda_ipc', 'vmm_fd'], "
    assert str(e.value).startswith(quoted) and quoted in text
    if cuda_vmm.available():
        pytest.skip("cuda-bindings is installed here: the missing-package message cannot be produced")
    with pytest.raises(cuda_vmm.CudaVmmError) as e:
        cuda_vmm._driver()
    assert f"`{e.value}`" in text
