"""A daemon's life: killed ranks, stale sockets and their recovery, copy mode's release, SIGTERM."""

from __future__ import annotations

import logging
import os
import signal

import pytest
import torch
from itest import call, default_socket, rank_pids, wait_until
from procs import free_port, http
from wcache.core.config import EngineConfig
from wcache.engine.loading.registry import load_weights
from wcache.errors import WeightCacheError, WeightCacheTimeoutError
from wcache.engine.loading.config import LoaderConfig
from wcache.model.llama import bind_weights, build_meta_model

PROMPT = [256, *b"restart me"]


def load(model_dir, caplog=None, **loader):
    """(logits, report, lease) for an engine loading with these loader keys."""
    cfg = EngineConfig.build(str(model_dir), "auto", None, "cpu")
    loaded = load_weights(cfg, "ipc_cache" if loader is not None else "safetensors", LoaderConfig(**loader))
    loaded.settle()  # copy mode lets go of the daemon's memory in the background
    weights, report, lease = loaded
    model = bind_weights(build_meta_model(cfg.shape, cfg.quant, cfg.dtype), weights.bindable())
    return model(torch.tensor(PROMPT), 0, model.new_cache(len(PROMPT))), report, lease


def disk_logits(model_dir):
    cfg = EngineConfig.build(str(model_dir), "auto", None, "cpu")
    weights, _, _lease = load_weights(cfg, "safetensors")
    model = bind_weights(build_meta_model(cfg.shape, cfg.quant, cfg.dtype), weights.bindable())
    return model(torch.tensor(PROMPT), 0, model.new_cache(len(PROMPT)))


def release(lease):
    if lease is not None:
        lease.close()


def test_a_killed_rank_leaves_a_stale_socket_that_the_next_daemon_recovers(procs, tiny_model, wcache_env, caplog):
    caplog.set_level(logging.INFO, "wcache.engine.loader")
    port = free_port()
    health = f"http://127.0.0.1:{port}/health"
    first = procs.preload(tiny_model, "--weight-cache-health-port", str(port), "--weight-cache-health-host", "127.0.0.1")
    sock = default_socket(wcache_env)
    assert http("GET", health)[0] == 200

    [rank] = rank_pids(first.pid)
    os.kill(rank, signal.SIGKILL)
    first.wait_for_log("Weight cache daemon rank(s) exited: {0: -9}; /health now answers 503", timeout=30)
    assert http("GET", health) == (503, {"status": "failed"})
    assert sock.exists() and os.path.exists(f"{sock}.lock")  # nobody removed them

    refused = f"Cannot connect to weight cache daemon at {sock}: [Errno 111] Connection refused"
    _, report, _lease = load(tiny_model)
    assert report.source == "disk" and report.fallback_reason == refused
    assert f"Weight cache unusable ({refused}); falling back to disk loading" in caplog.text
    with pytest.raises(WeightCacheTimeoutError) as err:  # a refused socket is worth waiting for
        load(tiny_model, fallback=False, state_timeout_s=0.6)
    assert str(err.value) == f"Weight cache daemon did not become ready within 0.6s: {refused}"
    first.stop()

    second = procs.preload(tiny_model)
    assert f"Removing stale socket {sock} left by a previous daemon" in second.log()
    logits, report, lease = load(tiny_model, fallback=False)
    try:
        assert report.source == "the weight cache (zero_copy)"
        assert torch.equal(logits, disk_logits(tiny_model))
    finally:
        release(lease)


def test_copy_mode_releases_the_daemon_and_sigterm_removes_the_socket(procs, tiny_model, wcache_env, caplog):
    caplog.set_level(logging.INFO, "wcache.engine.loader")
    port = free_port()
    daemon = procs.preload(tiny_model, "--weight-cache-health-port", str(port), "--weight-cache-health-host", "127.0.0.1")
    sock = default_socket(wcache_env)
    expected = disk_logits(tiny_model)

    # While a zero_copy engine maps the weights, a copy-mode engine gets its copy but no release.
    zero, zero_report, zero_lease = load(tiny_model, fallback=False)
    copy, report, lease = load(tiny_model, fallback=False, mode="copy")
    assert ("The daemon kept its copy of the weights: protocol error from the weight cache daemon: in_use: "
            "release refused: 1 engine(s) still map the weights in zero_copy mode") in caplog.text
    release(zero_lease)
    wait_until(lambda: call(sock, "get_memory")["zero_copy_engines"] == 0, 10, "the zero_copy lease to end")
    assert call(sock, "get_memory")["released"] is False
    assert torch.equal(zero, expected) and torch.equal(copy, expected)

    caplog.clear()
    copy, report, lease = load(tiny_model, fallback=False, mode="copy")
    assert "Mapped 27 tensors from the weight cache daemon (copy mode)" in caplog.text
    assert report.source == "the weight cache (copy)" and report.external_bytes == 0 and lease is None
    assert torch.equal(copy, expected)
    daemon.wait_for_log("Released the cached weights at an engine's request (copy mode)", timeout=10)
    memory = call(sock, "get_memory")
    assert memory["released"] is True and memory["weights_bytes"] == 0

    _, report, _lease = load(tiny_model)  # the next engine: released, so disk
    assert report.source == "disk" and report.fallback_reason == "Weights were released"
    assert "Weight cache unusable (Weights were released); falling back to disk loading" in caplog.text
    with pytest.raises(WeightCacheError, match="^Weights were released$"):
        load(tiny_model, fallback=False)

    assert daemon.stop(signal.SIGTERM) == 0
    assert not os.path.lexists(sock)
    assert f"Rank 0 stopped; socket {sock} removed" in daemon.log()
    with pytest.raises(OSError) as err:
        http("GET", f"http://127.0.0.1:{port}/health", timeout=2)
    assert isinstance(err.value.reason, ConnectionRefusedError)


def test_a_rank_that_does_not_stop_is_killed_and_its_socket_removed(procs, tiny_model, wcache_env):
    """A rank stuck on stop (here SIGSTOPped: the SIGTERM stays pending) never reaches its own
    cleanup. The launcher kills it after --weight-cache-stop-timeout and removes the socket, since
    nothing listens there; the lock file stays, as after any daemon."""
    daemon = procs.preload(tiny_model, "--weight-cache-stop-timeout", "1.5")
    sock = default_socket(wcache_env)
    [rank] = rank_pids(daemon.pid)
    os.kill(rank, signal.SIGSTOP)
    assert daemon.stop(signal.SIGTERM) == 1  # stopped, but not cleanly: the supervisor sees it
    log = daemon.log()
    assert "Rank 0 did not stop within 2 s of SIGTERM; killed it (SIGKILL)" in log
    assert f"Removed killed rank 0's socket {sock}: nothing listens there" in log
    assert not os.path.lexists(sock)
    again = procs.preload(tiny_model)  # the device is free: the next daemon finds no stale socket
    assert "Removing stale socket" not in again.log()
