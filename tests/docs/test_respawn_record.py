"""The respawn records (docs/benchmarks/*.json with a ``respawn`` key, written by `wcache bench
--respawn`) and the pages that show them: docs/benchmarks.md's section and docs/respawn.md's memory
table are the records' renders, and each record holds what the guide says of it."""

from __future__ import annotations

from pathlib import Path

import doc_tables
import respawn_tables

DOCS = Path(__file__).resolve().parents[2] / "docs"


def region(page: str, name: str) -> str:
    return dict(doc_tables.regions((DOCS / page).read_text(encoding="utf-8")))[name]


def test_there_is_a_cpu_record():
    assert any(d["environment"]["device"] == "cpu" for _, d in respawn_tables.respawn_records())


def test_the_pages_show_every_record_as_rendered():
    assert region("benchmarks.md", "bench-respawn") == respawn_tables.respawn_table()
    assert region("respawn.md", "respawn-memory") == respawn_tables.respawn_memory()
    for path, d in respawn_tables.respawn_records():
        row = next(line for line in region("benchmarks.md", "bench-respawn").splitlines() if path.name in line)
        assert f"{d['ratios']['restart_from_disk_over_respawn']:.1f}x" in row
        assert row.endswith(f"| {d['failed_requests']} | {d['refused_connections']} |")
        assert path.name in region("respawn.md", "respawn-memory")


def test_each_record_holds_what_the_guide_claims():
    for path, d in respawn_tables.respawn_records():
        kills = d["respawn"]["kills"]
        assert kills and len(kills) == d["repeat"], path.name
        # No client was refused, and at most the request in flight at each kill failed, closed.
        assert d["refused_connections"] == 0 == sum(k["refused"] for k in kills), path.name
        assert all(len(k["failed"]) <= 1 and all(f["kind"] == "closed" for f in k["failed"]) for k in kills)
        assert all(k["cause"] == "signal SIGKILL" for k in kills)
        # The ratio is the medians' own; the spare's memory was measured.
        m = d["median_s"]
        ratio = m["restart_from_disk"] / m["death_to_next_200"]
        assert abs(d["ratios"]["restart_from_disk_over_respawn"] - ratio) <= 0.01 * ratio
        assert d["respawn"]["memory"]["spare_rss_bytes"] > 0
        if d["environment"]["device"] == "cpu":
            assert m["death_to_next_200"] <= 1.5, path.name  # the CPU claim of docs/respawn.md


def test_the_phases_add_up_and_the_supervisor_is_small():
    """Records since the phases (issue 34): every kill's phases add up to its kill to the next
    200, and the supervisor, which no longer imports torch, holds under 60 MiB."""
    with_phases = [(p, d) for p, d in respawn_tables.respawn_records() if "median_kill_phases_s" in d]
    assert any(d["environment"]["device"] == "cpu" for _, d in with_phases)
    for path, d in with_phases:
        for k in d["respawn"]["kills"]:
            assert abs(sum(k["phases_s"].values()) - k["death_to_next_200_s"]) <= 0.001, (path.name, k)
        assert d["respawn"]["memory"]["supervisor_rss_bytes"] < 60 * 2**20, path.name
        assert d["median_kill_phases_s"] in [k["phases_s"] for k in d["respawn"]["kills"]]
        assert path.name in region("respawn.md", "respawn-phases")
