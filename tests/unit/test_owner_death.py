"""core/owner_death.py with real processes: a SIGKILLed owner is reported before its socket closes.

The owner is a real child process that holds the robust mutex and 512 MiB of written memory; the
kernel gives that memory back before it closes the child's descriptors, so the socket's end comes
late and the owner-died wake does not. A stopped owner is not reported, nor a live one."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
from wcache.core import owner_death
from wcache.core.owner_death import OwnerDeath

pytestmark = pytest.mark.skipif(not owner_death.available(), reason="needs Linux with glibc's robust mutexes")

OWNER = r"""
import socket, sys, time
from wcache.core.owner_death import OwnerDeath
sock = socket.socket(fileno=int(sys.argv[2]))
OwnerDeath(int(sys.argv[1])).hold()
memory = bytearray(b"\x01") * (int(sys.argv[3]) << 20)  # written: the kernel frees each page at exit
sock.send(b"held")
time.sleep(600)
"""


def start_owner(death: OwnerDeath, mib: int = 512):
    mine, theirs = socket.socketpair()
    proc = subprocess.Popen([sys.executable, "-c", OWNER, str(death.fd), str(theirs.fileno()), str(mib)],
                            pass_fds=(death.fd, theirs.fileno()))
    theirs.close()
    mine.settimeout(60)
    assert mine.recv(4) == b"held"
    return proc, mine


def test_a_killed_owner_is_reported_before_its_socket_closes():
    death = OwnerDeath()
    proc, sock = start_owner(death)
    seen: dict[str, float] = {}
    died = threading.Event()
    death.watch(lambda: (seen.setdefault("owner_died", time.monotonic()), died.set()))

    def read_eof() -> None:
        sock.settimeout(None)
        assert sock.recv(1) == b""
        seen["socket_closed"] = time.monotonic()

    reader = threading.Thread(target=read_eof)
    reader.start()
    time.sleep(0.2)  # both waiting
    killed = time.monotonic()
    os.kill(proc.pid, signal.SIGKILL)
    reader.join(30)
    assert died.wait(30), "the owner's death was never reported"
    proc.wait()
    ms = {k: round((v - killed) * 1e3, 1) for k, v in seen.items()}
    print(f"after SIGKILL of an owner holding 512 MiB (ms): {ms}")
    assert seen["owner_died"] < seen["socket_closed"], ms


def test_a_live_or_stopped_owner_is_not_reported_and_the_mutex_serves_a_next_owner():
    death = OwnerDeath()
    proc, sock = start_owner(death, mib=1)
    died = threading.Event()
    death.watch(died.set)
    assert not died.wait(0.3)  # alive
    os.kill(proc.pid, signal.SIGSTOP)
    assert not died.wait(0.5)  # stopped is not dead (the heartbeat's case, not this one's)
    os.kill(proc.pid, signal.SIGKILL)
    assert died.wait(30)
    proc.wait()
    sock.close()
    # The watcher made the mutex consistent and free again: a second owner holds it and dies alike.
    proc, sock = start_owner(death, mib=1)
    again = threading.Event()
    death.watch(again.set)
    assert not again.wait(0.3)
    proc.kill()
    assert again.wait(30)
    proc.wait()
    sock.close()


def test_wait_with_no_owner_returns_at_once_with_false():
    assert OwnerDeath().wait() is False
