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
    # Listening, not ready, and saying why: waiting for the daemon, not loading (a probe's log tells them apart).
    status, health = http("GET", f"{url}/health")
    assert status == 503 and health["status"] == "waiting_for_weight_cache", health
    assert health["socket"] == path and health["timeout_s"] == 120.0 and health["waited_s"] >= 0, health
    assert health["reason"] == f"no daemon socket at {path}", health
    status, body = http("POST", f"{url}/v1/completions", {"prompt": "Hi", "max_tokens": 1})
    assert status == 503 and body["error"]["message"] == "The engine is still loading its weights"

    daemon = procs.preload(tiny_model)
    waiting.wait_for(lambda: _healthy(waiting.port), timeout=60, what="/health 200 after the daemon started")
    assert http("GET", f"{url}/health") == (200, {"status": "ok"})
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


def test_under_respawn_health_says_the_worker_waits_for_the_daemon(procs, tiny_model, wcache_env):
    """Under --respawn the supervisor answers /health until a worker is ready; it says "waiting for
    the weight cache daemon" as the waiting worker's own server would (it once said "loading")."""
    engine = procs.serve(tiny_model, "--respawn", "--load-format", "ipc_cache", "--model-loader-extra-config",
                         '{"fallback": false, "state_timeout_s": 120}', ready=False)
    url = f"http://127.0.0.1:{engine.port}/health"
    path = f"{wcache_env['TMPDIR']}/wcache_{os.getuid()}/{socket_name(device_identity('cpu', 0))}"

    def waiting() -> bool:
        try:
            status, body = http("GET", url, timeout=2)
        except OSError:
            return False
        return status == 503 and body.get("status") == "waiting_for_weight_cache"

    engine.wait_for(waiting, timeout=120, what="/health saying waiting_for_weight_cache")
    status, body = http("GET", url)
    assert body["socket"] == path and body["reason"] == f"no daemon socket at {path}", body
    procs.preload(tiny_model)
    engine.wait_for(lambda: _healthy(engine.port), timeout=90, what="/health 200 after the daemon started")
    assert http("GET", url) == (200, {"status": "ok"})
