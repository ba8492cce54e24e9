"""docs/gpu-transports.md quotes the H200 records in docs/benchmarks/: every figure and matrix cell is
checked here against the JSON (and the GPU test logs), so none of them is typed by hand unchecked.

* the handoff and phase tables are generated regions (tools/doc_tables.py, checked fresh by
  tests/docs/test_tables.py); here: they show the newest llama-8b record of each transport, labelled
  by its sampling, and the prose quotes no figure but the model's size from those records;
* the namespace table: its cases, in order, are the ns-matrix records' cases, and each cell is
  `maps` or `fails` as the record says, for each transport;
* the GPU test results quoted are the logs' summary lines and failures;
* the messages quoted are the code's.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
import bench_records  # noqa: E402
import bench_tables  # noqa: E402

PAGE = ROOT / "docs" / "gpu-transports.md"
BENCH = ROOT / "docs" / "benchmarks"
TRANSPORTS = ("cuda_ipc", "vmm_fd")
MATRIX_RECORDS = {t: BENCH / f"2026-12-02-h200-ns-matrix-{t}.json" for t in TRANSPORTS}
GPU_LOG = BENCH / "2026-12-03-h200-gpu-tests.log"
OLD_GPU_LOG = BENCH / "2026-12-02-h200-gpu-tests.log"
FIGURE = re.compile(r"(?<![\w.])\d[\d,]*(?:\.\d+)?(?: ?(?:ms|µs|s|GiB|MiB|GB|MB)\b|x\b)")


def page() -> str:
    return PAGE.read_text(encoding="utf-8")


def prose(text: str) -> str:
    """The page without its fenced blocks, HTML comments and generated regions."""
    text = re.sub(r"(?s)<!-- generated: [^>]*-->.*?<!-- end generated -->", "", text)
    text = re.sub(r"(?ms)^(```+|~~~+).*?^\1\s*$", "", text)
    return re.sub(r"(?s)<!--.*?-->", "", text)


def newest() -> dict:
    return {bench_records.transport_of(p, d): (p, d) for p, d in bench_tables._newest_per_transport("llama-8b", BENCH)}


def test_the_tables_show_the_newest_record_of_each_transport_and_its_sampling():
    recs = newest()
    assert set(recs) == set(TRANSPORTS)
    text = page()
    for t, (path, d) in recs.items():
        assert d["environment"]["device"] == "cuda" and d["model"]["tensors"] == 195
        row = next(line for line in text.splitlines() if line.startswith(f"| `{t}` | ") and path.name in line)
        assert bench_records.sampling_label(d) in row
    assert bench_tables.transports_table() in text and bench_tables.transports_phases() in text


def test_the_prose_quotes_only_the_models_size_from_the_records():
    _, d = newest()["vmm_fd"]
    found = FIGURE.findall(prose(page()))
    assert found == [bench_records.fmt_bytes(d["model"]["bytes"])]
    assert f"{d['model']['tensors']} tensors" in page()


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
    log, old = GPU_LOG.read_text(encoding="utf-8"), OLD_GPU_LOG.read_text(encoding="utf-8")
    assert "1 failed, 17 passed" in log.splitlines()[-1] and "`1 failed, 17 passed`" in text
    assert re.findall(r"^FAILED (\S+)", log, re.M) == [
        "tests/gpu/test_cuda_path.py::test_a_restarted_daemon_adopts_a_vmm_arena_and_reloads_a_cuda_ipc_one[cuda_ipc]"]
    assert re.findall(r"^PASSED (\S+)", log, re.M).count(
        "tests/gpu/test_cuda_path.py::test_copy_mode_release_returns_the_daemons_memory[vmm_fd]") == 1
    assert re.findall(r"^FAILED (\S+)", old, re.M) == \
        ["tests/gpu/test_cuda_path.py::test_copy_mode_release_returns_the_daemons_memory[vmm_fd]"]
    assert "`test_copy_mode_release_returns_the_daemons_memory[vmm_fd]`" in text
    assert "`test_a_restarted_daemon_adopts_a_vmm_arena_and_reloads_a_cuda_ipc_one`" in text


def test_quoted_messages_are_the_codes():
    from wcache import errors
    from wcache.engine.loading.config import LoaderConfigError, parse_loader_config
    from wcache.wire.transports import cuda_vmm

    text = " ".join(page().split())
    assert errors.REASONS["transport"].format(served="cuda_ipc", wanted="vmm_fd") in text
    with pytest.raises(LoaderConfigError) as e:
        parse_loader_config({"transport": "nvlink"})
    quoted = "transport must be one of ['auto', 'cuda_ipc', 'vmm_fd'], "
    assert str(e.value).startswith(quoted) and quoted in text
    if cuda_vmm.available():
        pytest.skip("the CUDA driver library is here: the message for its absence cannot be produced")
    with pytest.raises(cuda_vmm.CudaVmmError) as e:
        cuda_vmm.driver()
    prefix = str(e.value).split("(")[0]
    assert prefix.startswith("the vmm_fd transport needs") and f"`{prefix}(...)`" in text


def test_the_guide_gpu_mode_result_quoted_is_the_recorded_output():
    """validation.md's account of the guide's GPU-mode run: pages run, of how many, and which failed."""
    out = (BENCH / "2026-12-03-h200-guide-gpu-mode-51e9f6f.txt").read_text(encoding="utf-8").splitlines()
    pages = next(line for line in out if line.startswith("# pages in collection order: ")).split(": ")[1].split()
    progress = next(line for line in out if line and not line.startswith("#"))
    failed = [p for p, mark in zip(pages, progress) if mark == "F"]
    text = " ".join((ROOT / "docs" / "validation.md").read_text(encoding="utf-8").split())
    assert f"after {len(progress)} of the {len(pages)} pages" in text
    assert "These pages failed: " + ", ".join(f"`{p}`" for p in failed) + "." in text
    assert "`21 passed`" in " ".join(page().split())
    assert "21 passed," in (BENCH / "2026-12-03-h200-make-test-gpu-51e9f6f.log").read_text(encoding="utf-8")
