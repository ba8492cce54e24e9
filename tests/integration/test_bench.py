"""`wcache bench`: the real command, timing disk, zero_copy and copy in one run."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from itest import run_cli
from procs import private_env
from wcache.bench.restart import PHASES
from wcache.bench.run import render_table
from wcache.bench.start import ENGINE_PHASES, FLOOR_PHASES
from wcache.errors import BenchError
from wcache.wire.sockets import MAX_SOCKET_PATH

ROOT = Path(__file__).resolve().parents[2]


def bench(model, env, repeat: int) -> dict:
    p = run_cli("bench", "--model", str(model), "--device", "cpu", "--json", "--repeat", str(repeat), env=env,
                timeout=600)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)  # stdout is the JSON alone; logs go to stderr


@pytest.fixture(scope="module")
def small_record(small_model, tmp_path_factory) -> dict:
    """One `wcache bench --repeat 3` on the small preset, read by the tests below: each sample
    starts fresh processes, so one run is most of this module's cost."""
    with private_env(tmp_path_factory.mktemp("bench") / "cache") as env:
        return bench(small_model, env, 3)


@pytest.mark.slow
def test_bench_json_has_seconds_and_ratios(small_record, small_model):
    r = small_record
    s, ratios = r["seconds"], r["ratios"]
    stored = len(json.loads((small_model / "model.safetensors.index.json").read_text())["weight_map"])
    layers = json.loads((small_model / "config.json").read_text())["num_hidden_layers"]
    # Post-processed, as served: q/k/v fused into one tensor and gate/up into one, per layer.
    assert r["model"]["tensors"] == stored - 3 * layers and r["model"]["path"] == str(small_model)
    assert r["repeat"] == 3
    assert r["environment"]["device"] == "cpu" and r["environment"]["torch"]
    for k in ("disk", "zero_copy", "copy", "key_first_sight", "key_restart"):
        assert s[k] > 0, k
    assert {k: len(v) for k, v in r["samples"].items()} == {"disk": 3, "zero_copy": 3, "copy": 3}
    assert ratios["disk_over_zero_copy"] == pytest.approx(s["disk"] / s["zero_copy"], rel=0.01, abs=0.01)
    assert ratios["disk_over_copy"] == pytest.approx(s["disk"] / s["copy"], rel=0.01, abs=0.01)
    assert ratios["key_restart_over_disk"] == pytest.approx(s["key_restart"] / s["disk"], rel=0.01, abs=1e-4)
    total = sum(p.stat().st_size for p in small_model.iterdir()  # shards + config.json: the weights' key
                if p.name.endswith(".safetensors") or p.name == "config.json")
    assert r["key_first_sight_bytes_hashed"] == total  # the first sight hashes every byte
    # The restart a user lives through: a real engine process to /health 200, split into phases.
    e = r["engine_start"]
    for fmt in ("disk", "ipc_cache"):
        phases = e[fmt]["phases_s"]
        assert list(phases) == list(ENGINE_PHASES) and e[fmt]["seconds"] > 0 and len(e[fmt]["samples"]) == 3
        assert phases["interpreter"] > 0 and phases["imports"] > 0 and phases["weights"] > 0
        assert phases["cuda_context"] == 0  # a CPU engine creates none
        assert sum(phases.values()) == pytest.approx(e[fmt]["seconds"], abs=0.01)
    # The run's first engine start measured the activation peak; every timed start reused it.
    assert e["ipc_cache"]["phases_s"]["activation_peak"] < 0.5 * e["ipc_cache"]["seconds"]
    assert e["disk_over_ipc_cache"] == pytest.approx(e["disk"]["seconds"] / e["ipc_cache"]["seconds"], rel=0.02)
    # The floor of the same run: a bare interpreter importing torch (no CUDA context on a CPU).
    floor = e["floor"]
    assert list(floor["phases_s"]) == list(FLOOR_PHASES) and len(floor["samples"]) == 3
    assert floor["phases_s"]["import_torch"] > 0 and floor["phases_s"]["cuda_context"] < 0.05
    assert sum(floor["phases_s"].values()) == pytest.approx(floor["seconds"], abs=0.01)
    assert floor["seconds"] > 0  # below the engine's start in principle; on a loaded machine either may win
    assert e["ipc_cache_over_floor_s"] == pytest.approx(e["ipc_cache"]["seconds"] - floor["seconds"], abs=1e-3)
    # A daemon killed under a zero_copy engine: the next one adopts the engine's arena (memfd here).
    h = r["handback"]
    assert h["adopted"] is True and h["restart_to_ready_s"] > 0 and h["first_start_to_ready_s"] > 0
    assert_restart_phases(h)
    # A standby started beside the restarted daemon takes over when that one is SIGKILLed: it adopts
    # the engine's arena, the engine answers the same, and its takeover costs less than a start.
    assert h["standby_adopted"] is True and h["standby_engine_answered_the_same"] is True, h
    assert 0 < h["standby_takeover_s"] < h["restart_to_ready_s"], h
    assert h["standby_over_first_start"] == pytest.approx(h["standby_takeover_s"] / h["first_start_to_ready_s"], abs=1e-3)
    assert h["standby_phases_s"]["import_arena"] > 0 and h["standby_phases_s"]["load"] < 0.05, h
    assert h["standby_rss_mib"] > 50  # two interpreters with torch imported, measured
    table = render_table(r)
    assert "ipc_cache zero_copy" in table and "cache key: first sight" in table
    assert "engine start to /health 200" in table and "daemon restart to READY" in table
    assert "standby takeover" in table and "standby phases (s)" in table


def assert_restart_phases(h: dict) -> None:
    """Both daemon starts split into bench/restart.py PHASES that add up to their totals; the restart
    adopted (import_arena, no load from disk) and the first start loaded; a floor was measured."""
    for key, total in (("first_start_phases_s", "first_start_to_ready_s"), ("restart_phases_s", "restart_to_ready_s")):
        phases = h[key]
        assert list(phases) == list(PHASES), phases
        assert sum(phases.values()) == pytest.approx(h[total], abs=0.02), (key, phases, h[total])
        assert phases["imports"] > 0 and phases["cuda_context"] == 0  # a CPU daemon creates none
    assert h["first_start_phases_s"]["load"] > 0 and h["first_start_phases_s"]["import_arena"] == 0
    assert h["restart_phases_s"]["import_arena"] > 0
    assert h["floor_s"] > 0 and h["floor_command"] == "import torch"


def test_the_published_cpu_record_restarts_with_adoption_below_its_first_start():
    """docs/benchmarks/cpu/: the CPU bench record shown on docs/benchmarks.md. A restart that adopts the
    engine's arena must beat a start that loads from disk, in total and with its phases."""
    [record] = sorted((ROOT / "docs" / "benchmarks" / "cpu").glob("*.json"))
    h = json.loads(record.read_text())["handback"]
    assert h["adopted"] is True
    assert_restart_phases(h)
    assert h["restart_to_ready_s"] < h["first_start_to_ready_s"], h
    assert h["restart_phases_s"]["load"] < h["first_start_phases_s"]["load"], h  # no weights read from disk


def test_a_daemon_that_fails_to_start_has_its_last_log_lines_printed(tiny_model, wcache_env, tmp_path):
    """The bench's work directory is gone when it exits: the daemon's own lines must be in its output.
    Here the daemon cannot save its autotune result (the cache directory is a file), which is fatal
    for a daemon and touches nothing of the bench's disk samples before it."""
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    env = {**wcache_env, "WCACHE_AUTOTUNE_CACHE_DIR": str(blocker)}
    p = run_cli("bench", "--model", str(tiny_model), "--device", "cpu", "--repeat", "1", env=env, timeout=300)
    assert p.returncode == 2, p.stderr
    lines = p.stderr.strip().splitlines()
    quoted = [line for line in lines if "[wcache.bench] daemon: " in line]
    assert quoted and any("Autotune" in line for line in quoted), p.stderr[-3000:]
    assert lines[-1].endswith(BenchError.FAILED.format(what="the weight cache daemon's start", code=2, who="daemon",
                                                       lines=len(quoted))), lines[-1]


@pytest.mark.slow
def test_bench_small_zero_copy_is_20x_faster_than_disk(small_record):
    """The issue's target: on the small preset, zero_copy weights-ready at least 20x faster than
    a disk load from the page cache; a restarted engine's key costs a small fraction of a load."""
    r = small_record
    s, ratios = r["seconds"], r["ratios"]
    print(f"small: disk {s['disk']:.4f} s, zero_copy {s['zero_copy']:.4f} s ({ratios['disk_over_zero_copy']}x), "
          f"copy {s['copy']:.4f} s; key first sight {s['key_first_sight']:.4f} s, restart {s['key_restart']:.4f} s; "
          f"zero_copy steps (ms) {r.get('zero_copy_phases_ms')}")
    assert r["model"]["bytes"] > 400 << 20
    # Compared on each source's fastest sample, as timeit advises: a slower one measures what else
    # ran on the machine (here the other test worker). On this 2-core machine, busy with a second
    # suite, the medians gave 22x to 37x over three runs: too little margin for a median.
    best = min(r["samples"]["disk"]) / min(r["samples"]["zero_copy"])
    print(f"fastest samples: {best:.1f}x")
    assert best >= 20, r
    assert ratios["key_restart_over_disk"] < 0.05, r


def test_bench_runs_under_a_tmpdir_too_deep_for_a_unix_socket(tiny_model, wcache_env):
    """The bench picks its own short socket directory: a TMPDIR whose path alone is longer than a
    Unix socket address may be (as under a CI runner's or pytest's temp directories) changes nothing."""
    deep = Path(wcache_env["TMPDIR"], *(["deeper-than-a-socket-address-may-reach"] * 4))
    deep.mkdir(parents=True)
    assert len(os.fsencode(deep)) > MAX_SOCKET_PATH
    r = bench(tiny_model, {**wcache_env, "TMPDIR": str(deep)}, 1)
    assert r["seconds"]["zero_copy"] > 0 and r["handback"]["adopted"] is True
