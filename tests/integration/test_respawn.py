"""`wcache serve --respawn` (engine/respawn.py, engine/spare.py) with real processes and clients.

The serving worker is killed with SIGKILL under a steady client: no connection is refused, at most
the request in flight fails (its connection is closed), and answers resume within 1.5 s, served
by the spare on the same socket with the same loader, memory plan and autotune as the first
worker. Repeated deaths back off and end the supervisor with status 1; a worker's configuration
error ends it with status 2; SIGTERM stops the workers and the spare; multi-rank engines are
refused with a message that names the flag.
"""

from __future__ import annotations

import http.client
import os
import re
import signal
import socket
import threading
import time

import pytest
from itest import child_pids, run_cli, wait_until
from wcache.bench.respawn import failure_kind, kill_under_load, post
from wcache.engine.respawn import BACKOFF_S, MAX_DEATHS, STABLE_S
from wcache.errors import MAPPED, RespawnError

SPARE = "Spare engine worker pid"
IPC = ("--load-format", "ipc_cache", "--model-loader-extra-config", '{"fallback": false}')


def ready_pids(log: str) -> list[int]:
    return [int(x) for x in re.findall(r"Engine ready \(pid (\d+)\)", log)]


def spare_pids(log: str) -> list[int]:
    return [int(x) for x in re.findall(SPARE + r" (\d+) ready", log)]


def wait_spares(p, n: int, timeout: float = 120) -> None:
    """Until ``n`` workers have logged that they wait as spares."""
    p.wait_for(lambda: len(spare_pids(p.log())) >= n, timeout, f"{n} spare lines")


def refused(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


@pytest.mark.parametrize("load_format", ["ipc_cache", "safetensors"])
def test_a_killed_worker_is_replaced_on_the_same_socket_and_no_client_is_refused(procs, tiny_model, load_format):
    if load_format == "ipc_cache":
        procs.preload(tiny_model)
    p = procs.serve(tiny_model, "--respawn", *(IPC if load_format == "ipc_cache" else ("--load-format", "safetensors")))
    wait_spares(p, 1)
    first, spare = ready_pids(p.log())[0], spare_pids(p.log())[0]
    assert first not in spare_pids(p.log())  # the first worker was promoted as soon as it had imported
    assert "CUDA initialized: False" in p.log()  # the spare imported torch and wcache and nothing more

    sample = kill_under_load(p.port, first)
    assert sample["refused"] == 0, sample
    assert len(sample["failed"]) <= 1, sample  # at most the request in flight, and it failed cleanly
    assert all(f["kind"] == "closed" and f["sent_before_kill"] for f in sample["failed"]), sample
    assert sample["death_to_next_200_s"] <= 1.5, sample

    p.wait_for_log(f"Respawned: engine worker pid {spare} ready")
    log = p.log()
    assert f"Engine worker pid {first} died (signal SIGKILL); promoting spare pid {spare}" in log
    assert ready_pids(log) == [first, spare]
    # The promoted spare took the same path as the first worker: its loader, memory plan and autotune.
    plans = re.findall(r"Memory plan \(bytes\): (.*)", log)
    assert len(plans) == 2 and plans[0] == plans[1], plans
    if load_format == "ipc_cache":
        assert log.count(MAPPED.format(count=27, mode="zero_copy")) == 2, log
    else:
        assert len(re.findall(r"Loaded 27 tensors \(1\.8 MiB\) from disk", log)) == 2, log
    assert log.count("[Autotuner]: Tuned") <= 1  # the second worker reuses what was tuned

    wait_spares(p, 2)  # a new spare is ready for the next death
    workers = child_pids(p.pid)
    assert len(workers) == 2
    assert p.stop() == 0  # SIGTERM: the serving worker and the spare stop, the socket closes
    assert not [w for w in workers if os.path.exists(f"/proc/{w}")]
    assert refused(p.port)
    assert "Respawn supervisor stopped" in p.log()


def test_a_request_in_flight_at_the_death_gets_a_closed_connection_not_a_hang(procs, tiny_model):
    p = procs.serve(tiny_model, "--respawn", "--max-model-len", "512")
    wait_spares(p, 1)
    victim = ready_pids(p.log())[0]
    outcome = {}

    def long_request():
        import json
        import urllib.request

        req = urllib.request.Request(f"http://127.0.0.1:{p.port}/v1/completions", method="POST",
                                     data=json.dumps({"prompt": "Hello", "max_tokens": 500}).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                outcome["status"] = r.status
        except Exception as e:  # noqa: BLE001
            outcome["error"] = failure_kind(e)
        outcome["at"] = time.monotonic()

    # An idle keep-alive connection the worker accepted before it died.
    idle = http.client.HTTPConnection("127.0.0.1", p.port, timeout=30)
    idle.request("GET", "/health")
    first_answer = idle.getresponse()
    assert first_answer.status == 200 and first_answer.read()

    t = threading.Thread(target=long_request)
    t.start()
    time.sleep(0.3)  # 500 tokens take seconds here: the request is being decoded
    killed = time.monotonic()
    os.kill(victim, signal.SIGKILL)
    t.join(30)
    assert outcome.get("error") == "closed", outcome
    assert outcome["at"] - killed < 2.0, outcome  # at once, not after a timeout
    assert post(p.port) == 200  # and the next request is answered by the promoted spare
    with pytest.raises((http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError)):
        idle.request("GET", "/health")  # the keep-alive connection died with its worker
        idle.getresponse()
    idle.close()


@pytest.mark.slow
def test_repeated_deaths_back_off_then_the_supervisor_exits_1(procs, tiny_model):
    p = procs.serve(tiny_model, "--respawn")
    for n in range(1, MAX_DEATHS + 1):
        p.wait_for(lambda: len(ready_pids(p.log())) >= n, 180, f"worker {n} ready")
        os.kill(ready_pids(p.log())[-1], signal.SIGKILL)  # each dies well within STABLE_S of being ready
    assert p.exit_code(120) == 1
    log = p.log()
    assert "died (signal SIGKILL); promoting spare pid" in log
    for crash in range(2, MAX_DEATHS):
        delay = BACKOFF_S * 2 ** (crash - 2)
        assert f"in {delay:g} s (crash {crash} in a row; at {MAX_DEATHS} --respawn gives up)" in log, log
    # The waits are real: each respawn after a back-off took at least its delay.
    seconds = [float(s) for s in re.findall(r"ready ([\d.]+) s after worker pid", log)]
    assert len(seconds) == MAX_DEATHS - 1
    assert all(s >= BACKOFF_S * 2 ** (i - 1) for i, s in enumerate(seconds) if i), seconds
    assert RespawnError.GAVE_UP.format(deaths=MAX_DEATHS, stable=STABLE_S, cause="signal SIGKILL") in log
    wait_until(lambda: not child_pids(p.pid), 30, "no worker left")


def test_a_configuration_error_of_the_worker_ends_the_supervisor_with_status_2(procs, tiny_model):
    # No daemon and no fallback: the worker gives up waiting for one (exit status 2, its own error).
    p = procs.serve(tiny_model, "--respawn", "--load-format", "ipc_cache", "--model-loader-extra-config",
                    '{"fallback": false, "state_timeout_s": 1}', ready=False)
    assert p.exit_code(180) == 2
    log = p.log()
    worker = int(re.search(r"engine worker pid (\d+) starts", log).group(1))
    assert "Weight cache daemon did not become ready within 1.0s" in log
    assert RespawnError.CONFIG.format(pid=worker) in log
    assert "died" not in log  # not counted as a crash: nothing was respawned


def test_more_than_one_rank_is_refused_naming_the_flag(tiny_model, wcache_env):
    r = run_cli("serve", str(tiny_model), "--device", "cpu", "--respawn", "--tensor-parallel-size", "2",
                env=wcache_env)
    assert r.returncode == 2, r.stderr
    assert "--respawn supports an engine of one rank; this one has 2 ranks (" in r.stderr, r.stderr
    assert "Drop --respawn and restart the engine from outside (docs/respawn.md)" in r.stderr
    assert "Respawn supervisor" not in r.stderr  # refused before any worker started


def test_a_taken_port_is_refused_before_any_worker_starts(tiny_model, wcache_env):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = run_cli("serve", str(tiny_model), "--device", "cpu", "--respawn", "--host", "127.0.0.1",
                    "--port", str(port), env=wcache_env)
    assert r.returncode == 2
    assert f"Cannot serve on 127.0.0.1:{port}: the port is already in use" in r.stderr
