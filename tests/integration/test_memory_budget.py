"""The memory budget with real processes on CPU (`--cpu-memory-capacity`): the daemon's weights are
counted exactly once, as the daemon reports them; the KV cache gets the rest and caps the request
length; the exceed error; copy mode and the disk fallback after it count the weights as the
engine's own."""

from __future__ import annotations

import json
import re

from itest import call, default_socket
from procs import complete, http
from wcache.core.config import EngineConfig
from wcache.core.disk import load_processed

PLAN = re.compile(r"Memory plan \(bytes\): (\{.*\})")
MiB = 1 << 20


def plan(log: str) -> dict:
    found = PLAN.findall(log)
    assert len(found) == 1, log
    p = json.loads(found[0])
    # The identity every plan satisfies, and the tokens it derives.
    assert p["budget"] == int(p["capacity"] * p["utilization"])
    assert p["own_weights"] + p["external_weights"] + p["activation_peak"] + p["kv_cache_bytes"] == p["budget"]
    assert p["kv_tokens"] == max(0, p["kv_cache_bytes"]) // p["kv_bytes_per_token"]
    return p


def weights_bytes(model) -> int:
    return load_processed(EngineConfig.build(str(model), device="cpu"), False).nbytes


def test_zero_copy_counts_the_daemons_weights_once_and_sizes_the_kv_cache(procs, tiny_model, wcache_env):
    procs.preload(tiny_model, "--no-enable-autotune")
    held = call(default_socket(wcache_env), "get_memory")["weights_bytes"]
    assert held == weights_bytes(tiny_model)  # exactly the cached tensors, not the arena's padding
    engine = procs.serve(tiny_model, "--load-format", "ipc_cache", "--no-enable-autotune",
                         "--cpu-memory-capacity", "8MiB", "--gpu-memory-utilization", "0.5")
    log = engine.log()
    p = plan(log)
    assert p["capacity"] == 8 * MiB and p["budget"] == 4 * MiB
    assert p["external_weights"] == held and p["own_weights"] == 0
    assert p["activation_peak"] > 0 and 0 < p["kv_tokens"] < 512, p
    assert ("Weights are held outside this process: 1.75 MiB by the weight cache daemon; budget 0.5 x 8.00 MiB = "
            "4.00 MiB = own weights 0 B + external weights 1.75 MiB + activation peak ") in log
    # The KV cache the budget leaves is the engine's max model length: longer requests are refused.
    n = p["kv_tokens"]
    assert f"Max model length 512 lowered to {n}" in log
    status, body = http("POST", f"http://127.0.0.1:{engine.port}/v1/completions", {"prompt": "Hello", "max_tokens": n})
    assert status == 400 and f"(max model length {n}, prompt 4 tokens)" in body["error"]["message"]
    assert complete(engine.port, "Hello", n - 4)["usage"]["total_tokens"] == n

    # The daemon's weights alone exceed 0.9 x 1 MiB: the engine refuses to start, the daemon serves on.
    small = procs.serve(tiny_model, "--load-format", "ipc_cache", "--no-enable-autotune",
                        "--cpu-memory-capacity", "1MiB", ready=False)
    assert small.exit_code() == 2
    assert ("Externally held weights (1.75 MiB) exceed the desired CPU memory utilization (0.9 x 1.00 MiB = "
            "921.60 KiB); they exceed the device's capacity") in small.log()
    tight = procs.serve(tiny_model, "--load-format", "ipc_cache", "--no-enable-autotune",
                        "--cpu-memory-capacity", "2MiB", "--gpu-memory-utilization", "0.5", ready=False)
    assert tight.exit_code() == 2
    assert ("Externally held weights (1.75 MiB) exceed the desired CPU memory utilization (0.5 x 2.00 MiB = "
            "1.00 MiB); raise --gpu-memory-utilization to at least 0.88") in tight.log()
    # That share holds the weights but not their activations as well: the next start says no share
    # fits and what gets past it, not to raise the share again (memory.md once advised 0.88).
    tighter = procs.serve(tiny_model, "--load-format", "ipc_cache", "--no-enable-autotune",
                          "--cpu-memory-capacity", "2MiB", "--gpu-memory-utilization", "0.88", ready=False)
    assert tighter.exit_code() == 2
    assert ("No utilization fits: the weights, the activation peak over 512 tokens (") in tighter.log()
    assert "of the device's 2.00 MiB. Lower --max-model-len" in tighter.log()
    assert complete(engine.port)["usage"]["completion_tokens"] == 8


def test_copy_mode_and_the_fallback_after_it_count_own_weights(procs, tiny_model, wcache_env):
    daemon = procs.preload(tiny_model, "--no-enable-autotune")
    flags = ("--load-format", "ipc_cache", "--no-enable-autotune", "--cpu-memory-capacity", "64MiB")
    copy = procs.serve(tiny_model, *flags, "--model-loader-extra-config", '{"mode": "copy"}')
    p = plan(copy.log())
    assert p["own_weights"] == weights_bytes(tiny_model) and p["external_weights"] == 0
    assert "Memory budget: budget 0.9 x 64.00 MiB" in copy.log()
    assert "held outside this process" not in copy.log()
    daemon.wait_for_log("Released the cached weights")
    assert call(default_socket(wcache_env), "get_memory")["weights_bytes"] == 0
    copy.stop()
    # The next engine finds the weights released and loads from disk: its own weights, nothing external
    # (the daemon still runs but holds nothing for it), so the same budget leaves the same KV cache.
    after = procs.serve(tiny_model, *flags)
    assert "Weight cache unusable (Weights were released); falling back to disk loading" in after.log()
    q = plan(after.log())
    assert q["own_weights"] == p["own_weights"] and q["external_weights"] == 0
    assert q["kv_tokens"] == p["kv_tokens"]
