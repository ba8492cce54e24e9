"""A running daemon's socket and socket directory tampered with, and engines of another uid.

The engine checks what it connects to (no symlinks, its own uid's socket, its own directory, a
listening process of its own uid); the daemon checks who connects (SO_PEERCRED) and, on shutdown, removes only the socket it bound. The
daemon keeps serving through all of it: once the tampering is undone, engines map again.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from faultlib import TALLY, alive, default_socket, rank_pids
from procs import free_port, http
from wcache.core.config import EngineConfig
from wcache.engine.loading.registry import load_weights
from wcache.errors import FALLBACK, REASONS, SocketSecurityError, WeightCacheError
from wcache.engine.loading.config import LoaderConfig


@pytest.fixture(scope="module")
def port():
    return free_port()


@pytest.fixture(scope="module")
def daemon(fault_procs, tiny_model, port):
    return fault_procs.preload(tiny_model, "--no-enable-autotune", "--weight-cache-health-port", str(port),
                               "--weight-cache-health-host", "127.0.0.1")


@pytest.fixture(scope="module")
def sock(daemon, fault_env):
    return default_socket(fault_env)


@pytest.fixture(scope="module")
def cfg(tiny_model):
    return EngineConfig.build(str(tiny_model), "auto", None, "cpu")


def maps_again(cfg, daemon, port) -> None:
    """The daemon served all along: an engine maps, and its health is 200."""
    _, report, lease = load_weights(cfg, "ipc_cache", LoaderConfig(fallback=False, state_timeout_s=10))
    assert report.source == "the weight cache (zero_copy)"
    lease.close()
    assert http("GET", f"http://127.0.0.1:{port}/health")[0] == 200
    assert alive(rank_pids(daemon.pid)[0])


def test_socket_replaced_by_a_symlink_or_a_file_after_start(daemon, sock, cfg, port, caplog):
    TALLY.fault("socket replaced by a symlink after the daemon started", "socket replaced by a regular file")
    caplog.set_level(logging.INFO, "wcache.engine.loader")
    aside = sock.with_name(sock.name + ".moved")
    os.rename(sock, aside)  # the daemon still listens on it, under the new name
    try:
        os.symlink(aside, sock)
        unsafe = REASONS["unsafe_socket"].format(path=sock, error=f"{sock} is a symlink")
        _, report, _lease = load_weights(cfg, "ipc_cache", LoaderConfig())
        assert report.source == "disk" and report.fallback_reason == unsafe
        assert FALLBACK.format(reason=unsafe) in caplog.text
        with pytest.raises(WeightCacheError) as err:  # not worth waiting for: fails at once
            load_weights(cfg, "ipc_cache", LoaderConfig(fallback=False, state_timeout_s=30))
        assert str(err.value) == unsafe
        os.unlink(sock)
        sock.write_text("")
        _, report, _lease = load_weights(cfg, "ipc_cache", LoaderConfig())
        assert report.fallback_reason == REASONS["unsafe_socket"].format(path=sock, error=f"{sock} is not a socket")
    finally:
        if os.path.lexists(sock):
            os.unlink(sock)
        os.rename(aside, sock)
    maps_again(cfg, daemon, port)


def test_socket_dir_replaced_by_a_symlink_after_start(daemon, sock, cfg, port):
    TALLY.fault("socket directory replaced by a symlink after the daemon started")
    d = sock.parent
    real = d.with_name(d.name + ".real")
    os.rename(d, real)
    try:
        os.symlink(real, d)
        # Not a fallback: the engine refuses the directory outright, with or without fallback.
        for fallback in (True, False):
            with pytest.raises(SocketSecurityError) as err:
                load_weights(cfg, "ipc_cache", LoaderConfig(fallback=fallback))
            assert str(err.value) == SocketSecurityError.SYMLINK_DIR.format(dir=d)
    finally:
        if os.path.islink(d):
            os.unlink(d)
        os.rename(real, d)
    maps_again(cfg, daemon, port)


OTHER_UID_ENGINE = r"""
import json, os, sys
from wcache.core.config import EngineConfig
from wcache.engine.loading.registry import load_weights
from wcache.engine.loading.config import LoaderConfig
cfg = EngineConfig.build(sys.argv[1], "auto", None, "cpu")
for _ in range(2):
    _, r, _lease = load_weights(cfg, "ipc_cache", LoaderConfig(socket_path=sys.argv[2]))
    print(json.dumps({"uid": os.getuid(), "source": r.source, "reason": r.fallback_reason}), flush=True)
    sys.stdin.readline()
# A client that skips the engine's checks and asks anyway: the daemon's own check answers.
import socket
from wcache.wire.protocol import recv_frame, request, send_frame
with socket.socket(socket.AF_UNIX) as s:
    s.connect(sys.argv[2])
    send_frame(s, request("get_state", key={}, mode="zero_copy"))
    print(json.dumps(recv_frame(s)[0]), flush=True)
"""


def test_an_engine_of_another_uid_is_refused_on_both_sides(daemon, sock, cfg, port, tiny_model):
    TALLY.fault("an engine of another uid")
    if os.getuid() != 0:
        pytest.skip("needs root to run an engine as uid 65534 (setpriv)")
    if not shutil.which("setpriv"):
        pytest.skip("setpriv (util-linux) is not installed")
    other = 65534
    world = Path(tempfile.mkdtemp(prefix="wf-uid-", dir="/tmp"))
    os.chmod(world, 0o755)
    model = Path(shutil.copytree(tiny_model, world / "model"))
    for p in [model, *model.iterdir()]:
        os.chmod(p, 0o755 if p.is_dir() else 0o644)
    (world / "cache").mkdir(mode=0o777)
    os.chmod(world / "cache", 0o777)
    # Let uid 65534 reach the socket's directory; the socket itself stays 0600 and root's.
    dirs = {p: stat.S_IMODE(os.lstat(p).st_mode) for p in (sock.parent.parent, sock.parent)}
    env = {**os.environ, "HOME": str(world), "TMPDIR": str(world), "WCACHE_CACHE_ROOT": str(world / "cache")}
    engine = None
    try:
        for p in dirs:
            os.chmod(p, 0o711)
        engine = subprocess.Popen(["setpriv", "--reuid", str(other), "--regid", str(other), "--clear-groups",
                                   sys.executable, "-c", OTHER_UID_ENGINE, str(model), str(sock)],
                                  env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True)
        # First line of defence, the engine's: the socket belongs to another user.
        first = json.loads(engine.stdout.readline() or "null")
        assert first == {"uid": other, "source": "disk", "reason": REASONS["unsafe_socket"].format(
            path=sock, error=f"{sock} is owned by uid 0, not {other}")}, engine.stderr.read() if not first else first
        # Second line, the engine's again: a socket the engine's uid owns, served by a process of
        # another uid (SO_PEERCRED), is refused before any request.
        os.chown(sock, other, other)
        engine.stdin.write("\n")
        engine.stdin.flush()
        second = json.loads(engine.stdout.readline() or "null")
        assert second == {"uid": other, "source": "disk", "reason": REASONS["untrusted_peer"].format(
            path=sock, pid=rank_pids(daemon.pid)[0], uid=0, owner=other, own=other)}, second
        # Third line, the daemon's: it checks the peer's uid (SO_PEERCRED) and refuses it.
        engine.stdin.write("\n")
        engine.stdin.flush()
        third = json.loads(engine.stdout.readline() or "null")
        assert third["error"] == "rejected" and third["message"] == REASONS["rejected"].format(uid=other), third
        engine.stdin.close()
        assert engine.wait(60) == 0, engine.stderr.read()
    finally:
        if engine is not None and engine.poll() is None:
            engine.kill()
        os.chown(sock, 0, 0)
        for p, mode in dirs.items():
            os.chmod(p, mode)
        shutil.rmtree(world, ignore_errors=True)
    daemon.wait_for_log(f"{REASONS['rejected'].format(uid=other)} (pid ", timeout=10)
    maps_again(cfg, daemon, port)


def test_shutdown_removes_only_the_socket_the_daemon_bound(daemon, sock, tmp_path):
    TALLY.fault("socket replaced by a symlink, then the daemon stops")
    victim = tmp_path / "victim"
    victim.write_text("not the daemon's")
    aside = sock.with_name(sock.name + ".moved")
    os.rename(sock, aside)
    os.symlink(victim, sock)
    assert daemon.stop(signal.SIGTERM) == 0
    assert os.path.islink(sock) and victim.read_text() == "not the daemon's"
    assert f"Rank 0 stopped; left {sock} alone: it is no longer the socket this daemon bound" in daemon.log()
    assert "Traceback" not in daemon.log()
