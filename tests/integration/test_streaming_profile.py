"""The streaming bench explains a step (engine/core/step_clock.py) and measures the bare step beside it
(bench/bare_step.py), in one run against a real `wcache serve` on CPU: the lone client's busy
period and the clients' are told apart, the GPU's columns are null with their reason, and the host
time's profile adds up."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

CLIENTS = 4


@pytest.fixture(scope="module")
def run(tiny_model, tmp_path_factory):
    out = tmp_path_factory.mktemp("profile") / "record.json"
    done = subprocess.run([sys.executable, "-m", "wcache.bench.streaming", str(tiny_model), "--clients", str(CLIENTS),
                           "--max-tokens", "8", "--vs-one", "--output", str(out)],
                          capture_output=True, text=True, check=False, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(out.read_text()), done.stderr


def test_the_record_explains_the_lone_clients_steps_and_the_clients_steps_apart(run):
    record, _ = run
    prof = record["step_profile"]
    one, many = prof["one_client"]["decode_steps"], prof["clients"]["decode_steps"]
    # 8 tokens: the first from the prompt's pass, 7 decode steps (the clients may join over two steps)
    assert one["steps"] == 7 and one["rows"] == 1 and one["graph_rows"] == 1, one
    assert 7 <= many["steps"] <= 8 and many["rows"] > 1, many
    assert prof["clients"]["prompts"] > 0 and many["prompts"] == 0
    for p in (prof["one_client"], prof["clients"], one, many):
        assert p["gpu_ms"] is None and p["gpu_idle_ms"] is None and p["gpu_idle_in_step_ms"] is None
        assert 0 < p["cpu_ms"] and 0 < p["host_ms"] <= p["step_ms"] + 1e-3
        phases = p["profile"]
        assert phases["decode_pass_ms"] > 0 and phases["hand_ms"] > 0 and phases["gpu_wait_ms"] == 0
        assert abs(sum(phases.values()) - p["host_ms"]) < 0.01, p  # every host millisecond has its phase
    assert "CPU engine" in prof["gpu_null_because"]


def test_the_bare_step_is_measured_in_the_same_run_and_shown(run):
    record, stderr = run
    bare = record["bare_step"]
    assert bare["mode"].startswith("eager") and bare["kv_length"] == 512, bare
    assert bare["tokens_per_s_1"] > 0 and bare["tokens_per_s_64"] > bare["tokens_per_s_1"], bare
    assert record["vs_bare"]["one_client"] > 0 and record["vs_bare"]["clients"] > 0
    assert "bare step (eager" in stderr and "one_client decode" in stderr and "clients    all" in stderr, stderr
