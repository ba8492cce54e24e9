"""Killed and stopped processes on both sides of a handoff, with real daemons and engines.

- The daemon rank hangs (SIGSTOP) while engines connect, then dies (SIGKILL): the engine that timed
  out, the ones still waiting and a `wcache serve` engine each fall back with their own reason; an
  engine that mapped the weights before keeps serving; the next engine finds the stale socket.
- An engine in copy mode is stopped while it copies the arena, then SIGKILLed: the daemon keeps its
  weights (nothing released), keeps no descriptor, and hands the next engine its copy.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time
from pathlib import Path

import pytest
from faultlib import (
    TALLY,
    alive,
    call,
    connections_to,
    default_socket,
    fd_count,
    rank_pids,
    settle,
    stop_when,
    wait_until,
)
from procs import complete, core_pids, free_port, http, two_processes
from wcache.core import checkpoint
from wcache.core.config import EngineConfig
from wcache.engine.loading.registry import load_weights
from wcache.errors import FALLBACK, MAPPED, REASONS
from wcache.engine.loading.config import LoaderConfig

pytestmark = pytest.mark.slow

# About 80 MB of bf16 weights: a copy long enough (tens of ms) to be caught in the act.
MID = checkpoint.Preset(512, 1408, 8, 8, 4, 16384, 512, 10000.0, 64 << 20)


@pytest.fixture(scope="module")
def mid_model(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(checkpoint.PRESETS, "fault-mid", MID)
        return checkpoint.make_checkpoint(tmp_path_factory.mktemp("ckpt") / "fault-mid", "fault-mid")


def lost_prefix(sock) -> str:
    return REASONS["lost"].split("(")[0].format(path=sock) + "("


def test_rank_killed_during_after_and_before_handoffs(fault_procs, fault_env, tiny_model, caplog):
    TALLY.fault("daemon rank hangs (SIGSTOP) during a handoff", "daemon rank SIGKILLed during handoffs",
                "daemon rank SIGKILLed after a handoff", "daemon rank SIGKILLed before a handoff (stale socket)")
    caplog.set_level(logging.INFO, "wcache.engine.loader")
    port = free_port()
    daemon = fault_procs.preload(tiny_model, "--no-enable-autotune", "--weight-cache-health-port", str(port),
                                 "--weight-cache-health-host", "127.0.0.1")
    sock = default_socket(fault_env)
    [rank] = rank_pids(daemon.pid)
    cfg = EngineConfig.build(str(tiny_model), "auto", None, "cpu")
    engine_flags = ("--load-format", "ipc_cache", "--no-enable-autotune")

    # After a handoff: this engine maps the weights (zero_copy) before anything goes wrong.
    mapped = fault_procs.serve(tiny_model, *engine_flags, name="mapped-engine")
    assert MAPPED.format(count=27, mode="zero_copy") in mapped.log()
    first = complete(mapped.port, "Hello", 8)

    os.kill(rank, signal.SIGSTOP)
    try:
        # A hung daemon: the engine's state timeout names it.
        _, report, _lease = load_weights(cfg, "ipc_cache", LoaderConfig(socket_path=str(sock), state_timeout_s=1.0))
        assert report.source == "disk"
        assert report.fallback_reason == REASONS["timeout"].format(path=sock, timeout=1.0)

        # During handoffs: eight engines and a `wcache serve` connect and wait on the stopped rank.
        base = connections_to(sock)
        reports: list = [None] * 8

        def engine(i: int) -> None:
            reports[i] = load_weights(cfg, "ipc_cache", LoaderConfig(socket_path=str(sock), state_timeout_s=120))[1]

        threads = [threading.Thread(target=engine, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        late = fault_procs.serve(tiny_model, *engine_flags, ready=False, name="late-engine")
        wait_until(lambda: connections_to(sock) >= base + 9, 120, "nine engines to connect to the stopped rank")
    finally:
        os.kill(rank, signal.SIGKILL)
    for t in threads:
        t.join(60)
    reasons = {r.fallback_reason for r in reports}
    assert all(r.source == "disk" for r in reports) and len(reasons) == 1, reasons
    [lost] = reasons
    assert lost.startswith(lost_prefix(sock)) and lost.endswith("it may have crashed or been stopped: see its log")
    assert lost in {REASONS["lost"].format(path=sock, error=e)
                    for e in ("[Errno 104] Connection reset by peer", "peer closed the connection")}, lost
    late.wait_for(lambda: http("GET", f"http://127.0.0.1:{late.port}/health", timeout=2)[0] == 200, 120, "/health 200")
    assert f"Weight cache unusable ({lost_prefix(sock)}" in late.log()
    daemon.wait_for_log("Weight cache daemon rank(s) exited: {0: -9}; /health now answers 503", timeout=30)
    assert http("GET", f"http://127.0.0.1:{port}/health") == (503, {"status": "failed"})

    # After the handoff, the mapped engine outlives the daemon: same answers, still healthy.
    assert complete(mapped.port, "Hello", 8)["choices"] == first["choices"]
    assert http("GET", f"http://127.0.0.1:{mapped.port}/health")[0] == 200

    # Before a handoff: the dead rank's socket is stale; the next engine is refused, says so, and loads from disk.
    assert sock.exists()
    _, report, _lease = load_weights(cfg, "ipc_cache", LoaderConfig(socket_path=str(sock)))
    refused = REASONS["refused"].format(path=sock, error="[Errno 111] Connection refused")
    assert report.source == "disk" and report.fallback_reason == refused
    assert FALLBACK.format(reason=refused) in caplog.text
    for p in (late, mapped, daemon):
        p.stop()


def test_engine_killed_mid_copy_leaves_the_daemon_serving(fault_procs, fault_env, mid_model, caplog):
    TALLY.fault("engine SIGKILLed while it copies the arena (copy mode)")
    caplog.set_level(logging.INFO, "wcache.engine.loader")
    daemon = fault_procs.preload(mid_model, "--no-enable-autotune")
    sock = default_socket(fault_env)
    [rank] = rank_pids(daemon.pid)
    fds = fd_count(rank)
    held = call(sock, "get_memory")
    assert held["weights_bytes"] > 60 << 20

    copy = json.dumps({"mode": "copy", "fallback": False})
    engine = fault_procs.serve(mid_model, "--load-format", "ipc_cache", "--model-loader-extra-config", copy,
                               "--no-enable-autotune", ready=False, name="copying-engine")
    copier = engine.pid  # the process that maps the arena: the engine core, with two processes (the default)
    if two_processes():
        wait_until(lambda: core_pids(engine.pid), 60, "the engine core's start", engine.log)
        [copier] = core_pids(engine.pid)
    maps = Path(f"/proc/{copier}/maps")
    # Catch the engine with the daemon's arena mapped, i.e. while it copies it. The copy lasts tens of
    # ms, less than a poll can promise on a loaded machine, so the engine runs in slices and the maps
    # are read while it is stopped.
    caught = stop_when(copier, lambda: "wcache-arena" in maps.read_text(), timeout=120)
    assert caught, "the engine never showed the arena mapped:\n" + engine.log()
    try:
        during = call(sock, "get_memory")
        assert during["released"] is False and during["zero_copy_engines"] == 0  # copy mode holds no lease
    finally:
        os.kill(copier, signal.SIGKILL)
    # One process dies of the signal; a front whose core died before Ready exits 1.
    assert engine.proc.wait(30) == (1 if copier != engine.pid else -signal.SIGKILL)
    assert "from the weight cache daemon (copy mode)" not in engine.log()  # it never finished

    # The daemon released nothing, kept no descriptor of the dead engine's, and serves the next one.
    assert alive(rank)
    after = call(sock, "get_memory")
    assert after["released"] is False and after["weights_bytes"] == held["weights_bytes"]
    leaked = settle(rank, fds)
    TALLY.leaked_fds += leaked
    assert leaked == 0
    cfg = EngineConfig.build(str(mid_model), "auto", None, "cpu")
    weights, report, lease = load_weights(cfg, "ipc_cache", LoaderConfig(mode="copy", fallback=False, socket_path=str(sock)))
    assert report.source == "the weight cache (copy)" and report.nbytes == held["weights_bytes"]
    assert MAPPED.format(count=len(weights.tensors), mode="copy") in caplog.text
    daemon.wait_for_log("Released the cached weights at an engine's request (copy mode)", timeout=10)
    assert call(sock, "get_memory")["released"] is True
    assert "Traceback" not in daemon.log()
