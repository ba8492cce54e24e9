"""The weight-seeding records (docs/benchmarks/*seed*.json, written by `wcache bench --seed`): each
holds the fields the issue asks for, its ratios follow from its figures, and the source sent the arena
about once for the fan-out round (a relay per replica, or gloo's binomial-tree broadcast, sends it
several times)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[2] / "docs"
RECORDS = sorted((DOCS / "benchmarks").glob("*seed*.json"))
FIELDS = ("date", "host", "commit", "model_bytes", "seed_gb_per_s", "raw_tcp_gb_per_s", "single_s", "disk_s")
FANOUT = ("fanout_4_s", "source_bytes_sent_4", "replica_bytes_sent_4")  # every record of a round of 4


def test_there_is_a_cpu_record_with_a_round_of_4():
    assert any(json.loads(p.read_text())["device"] == "cpu" and "fanout_4_s" in json.loads(p.read_text())
               for p in RECORDS)


@pytest.mark.parametrize("path", RECORDS, ids=[p.name for p in RECORDS])
def test_the_record_holds_its_fields_and_its_ratios_follow_from_them(path):
    d = json.loads(path.read_text())
    assert not [f for f in FIELDS if f not in d]
    assert d["seed_gb_per_s"] == round(d["model_bytes"] / d["seed_s"] / 1e9, 3)
    assert d["seed_vs_raw_tcp"] == round(d["seed_gb_per_s"] / d["raw_tcp_gb_per_s"], 3)
    if not any(k.startswith("fanout_") for k in d):  # `--seed-replicas 0` (one GPU): one replica against disk only
        assert d["device"] == "cuda" and d["single_vs_disk"] == round(d["single_s"] / d["disk_s"], 3)
        return
    assert not [f for f in FANOUT if f not in d]
    assert d["fanout_4_vs_single"] == round(d["fanout_4_s"] / d["single_s"], 3)
    assert d["model_bytes"] <= d["source_bytes_sent_4"] <= 1.1 * d["model_bytes"]
    assert len(d["replica_bytes_sent_4"]) == 4 and d["fanout_4_how"].startswith("a gloo scatter + ring all-gather")
