"""The pieces of the metrics that read the system: the standby count from the kernel's lock table,
and a zero_copy engine's view of whether its daemon still holds the lease."""

from __future__ import annotations

import fcntl
import os
import socket
import subprocess
import sys
import time

from wcache.daemon.metrics import lock_waiters
from wcache.engine.loading.lease import daemon_alive
from wcache.engine.api_server.metrics import load_labels
from wcache.engine.loading.base import LoadReport


def blocked_on(path) -> subprocess.Popen:
    """A process that blocks in flock(LOCK_EX) on ``path``, as a standby launcher does."""
    return subprocess.Popen([sys.executable, "-c", "import fcntl, os, sys; "
                             "fcntl.flock(os.open(sys.argv[1], os.O_RDWR), fcntl.LOCK_EX)", str(path)])


def test_lock_waiters_counts_the_processes_blocked_on_the_daemons_locks(tmp_path):
    mine, other = tmp_path / "a.sock.lock", tmp_path / "b.sock.lock"
    held = []
    for p in (mine, other):
        fd = os.open(p, os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX)
        held.append(fd)
    assert lock_waiters([mine]) == 0
    waiters = [blocked_on(mine), blocked_on(other)]
    try:
        deadline = time.monotonic() + 30  # both interpreters started and blocked (a loaded host is slow)
        while lock_waiters([mine, other]) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert lock_waiters([mine, other]) == 2
        assert lock_waiters([mine]) == 1  # the waiter on the other file is not counted
        assert lock_waiters([tmp_path / "missing.lock"]) == 0
    finally:
        for w in waiters:
            w.kill()
            w.wait()
        for fd in held:
            os.close(fd)


class _Lease:
    def __init__(self, sock):
        self.sock = sock


def test_daemon_alive_is_the_lease_connections_state_and_reads_nothing():
    engine, daemon = socket.socketpair()
    try:
        daemon.sendall(b"unread")  # data waiting is not a hang-up, and polling does not consume it
        assert daemon_alive(_Lease(engine)) == 1.0
        daemon.close()
        assert daemon_alive(_Lease(engine)) == 0.0
        assert engine.recv(16) == b"unread"
    finally:
        engine.close()
    assert daemon_alive(_Lease(engine)) == 0.0  # our own side closed


def test_load_labels_say_how_the_weights_came():
    cache = LoadReport("the weight cache (zero_copy)", 0.1, 27, 100, transport="memfd")
    assert load_labels(cache, "ipc_cache") == {"load_format": "ipc_cache", "source": "ipc_cache", "mode": "zero_copy",
                                               "transport": "memfd", "reason": None}
    disk = LoadReport("disk", 0.2, 27, 100, fallback_reason="no daemon socket at /x", fallback_kind="no_socket")
    assert load_labels(disk, "ipc_cache") == {"load_format": "ipc_cache", "source": "disk", "mode": "none",
                                              "transport": "none", "reason": "no_socket"}
