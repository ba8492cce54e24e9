"""The streaming-clients record(s) in docs/benchmarks/ (``python -m wcache.bench.streaming``): fit to
publish, and shown on docs/benchmarks.md as they are. docs/benchmarks.md's block runs the bench
itself against a real `wcache serve`."""

from __future__ import annotations

import copy

import doc_tables
import bench_records
from wcache.bench import streaming


def published() -> list[tuple]:
    return doc_tables.streaming_records()


def test_a_16_client_record_is_published_and_fit():
    found = published()
    assert any(d[streaming.RECORD_KEY] >= 16 for _, d in found), [p.name for p, _ in found]
    for path, d in found:
        assert streaming.problems(d) == [], path.name
        assert d["torch"] and d["date"] and d["machine"], path.name
        if d["device"] == "cpu":
            assert d["model"] == "tiny", path.name
        else:  # a GPU record (tools/gpu_run.sh stream): which GPU, driver and commit
            assert d["device"] == "cuda" and d["gpu"] and d["driver"] and d["commit"], path.name


def test_the_page_shows_every_record_with_its_figures():
    page = (bench_records.BENCH_DIR.parent / "benchmarks.md").read_text(encoding="utf-8")
    assert doc_tables.http_streaming() in page
    for path, d in published():
        row = next(line for line in page.splitlines() if path.name in line)
        assert f"| {d['ttft_s']['p50']:.2f} s | {d['ttft_s']['p99']:.2f} s |" in row


def test_an_unfit_record_is_named():
    _, good = published()[-1]
    bad = copy.deepcopy(good)
    bad["completed"] -= 1
    bad["refused"] = 1
    bad["ttft_s"]["p50"] = bad["ttft_s"]["p99"] + 1
    out = streaming.problems(bad)
    assert len(out) == 3 and "streams complete" in out[0] and "refused" in out[1] and "out of order" in out[2]
    assert streaming.problems({}) and "missing key" in streaming.problems({})[0]
