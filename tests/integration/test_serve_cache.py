"""`wcache serve --load-format ipc_cache` as a process: waiting for a starting daemon, and the
pitfall of an engine that starts first with fallback on."""

from __future__ import annotations

import os

from itest import call, default_socket
from procs import _healthy, complete, free_port, http
from wcache.core.device import device_identity
from wcache.wire.sockets import socket_name


def test_a_waiting_engine_maps_the_daemon_once_ready_an_early_one_keeps_its_disk_copy(procs, tiny_model, wcache_env):
    waiting = procs.serve(tiny_model, "--load-format", "ipc_cache", "--model-loader-extra-config",
                          '{"fallback": false, "state_timeout_s": 120}', ready=False, name="waiting")
    early = procs.serve(tiny_model, "--load-format", "ipc_cache", name="early")  # fallback true (default)
    path = f"{wcache_env['TMPDIR']}/wcache_{os.getuid()}/{socket_name(device_identity('cpu', 0))}"
    assert (f"Weight cache unusable (no daemon socket at {path}); falling back to disk loading"
            in early.log())
    assert "Loaded 27 tensors" in early.log() and "from disk in" in early.log()

    waiting.wait_for_log("Waiting up to 120.0s for the weight cache daemon to start")
    url = f"http://127.0.0.1:{waiting.port}"
    assert http("GET", f"{url}/health") == (503, {"status": "loading"})  # listening, not ready
    status, body = http("POST", f"{url}/v1/completions", {"prompt": "Hi", "max_tokens": 1})
    assert status == 503 and body["error"]["message"] == "The engine is still loading its weights"

    daemon = procs.preload(tiny_model)
    waiting.wait_for(lambda: _healthy(waiting.port), timeout=60, what="/health 200 after the daemon started")
    assert "Mapped 27 tensors from the weight cache daemon (zero_copy mode)" in waiting.log()
    assert complete(waiting.port, "Same?", 10)["choices"][0]["token_ids"] == \
        complete(early.port, "Same?", 10)["choices"][0]["token_ids"]
    # Only the waiting engine maps the daemon's weights; the early one holds a second copy.
    assert call(default_socket(wcache_env), "get_memory")["zero_copy_engines"] == 1
    assert daemon.proc.poll() is None


def test_fallback_false_without_a_daemon_waits_then_exits_2(procs, tiny_model, wcache_env):
    engine = procs.serve(tiny_model, "--load-format", "ipc_cache", "--model-loader-extra-config",
                         '{"fallback": false, "state_timeout_s": 1.0}', ready=False, port=free_port())
    assert engine.exit_code(120) == 2
    path = f"{wcache_env['TMPDIR']}/wcache_{os.getuid()}/{socket_name(device_identity('cpu', 0))}"
    log = engine.log()
    assert "Waiting up to 1.0s for the weight cache daemon to start" in log
    assert f"Weight cache daemon did not become ready within 1.0s: no daemon socket at {path}" in log
    assert log.index("Waiting up to 1.0s") < log.index("did not become ready")
