"""Another uid swaps its own listener in at the daemon's socket path ([sec-2] item 2).

A socket directory named with ``--weight-cache-socket-dir`` may be shared with a group (the guide
allows it). Any member of the group can then rename the daemon's socket aside and bind its own
listener at that path. The engine checks the socket file before it connects, but the swap can land
between that check and the connect; so, once connected, the engine checks who answers
(``SO_PEERCRED``) and refuses a peer whose uid is not the socket's owner, its own, with its own
reason (``untrusted_peer``), before it sends a request. It then loads from disk.

Mounted for real, as root: the attacker is a process of uid 65534 (``setpriv``; its group, 65534,
may write in the shared directory). First the state the race produces, made deterministic: its listener at the
path, the file owned by the engine's uid. Then the race itself, bounded in loads and time: the
attacker exchanges its socket with the daemon's (``renameat2(RENAME_EXCHANGE)``), so some engines
pass the file check on the daemon's file and connect to the attacker. The race test asserts that
happened (the attacker accepted connections), and a negative control runs the same race against a
copy of the client without its connect-time check, which must hand the attacker requests.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

import pytest
from faultlib import TALLY
from wcache.core.config import EngineConfig
from wcache.core.device import device_identity
from wcache.engine.loading import client as client_module
from wcache.engine.loading import ipc_cache
from wcache.engine.loading.config import LoaderConfig
from wcache.engine.loading.registry import load_weights
from wcache.errors import REASONS
from wcache.wire.sockets import socket_name

OTHER = 65534  # nobody / nogroup
RACE_LOADS = 60  # at least; then on until the race landed ENOUGH times (a busy machine swaps slower)
RACE_MAX_LOADS = 1000
RACE_SECONDS = 120.0
ENOUGH = 3

# The attacker: bind a listener at the daemon's path (the daemon's socket renamed aside), and
# report every connection and whether a request frame arrived on it.
ATTACKER = r"""
import json, os, socket, sys, threading, time
path, mode = sys.argv[1], sys.argv[2]
aside = path + ".aside"
seen = {"connections": 0, "requests": 0, "swaps": 0}
lock = threading.Lock()

def serve(listener):
    while True:
        try:
            conn, _ = listener.accept()
        except OSError:
            return
        with conn:
            conn.settimeout(2.0)
            try:
                data = conn.recv(8)  # a frame header: the engine sent a request
            except OSError:
                data = b""
            with lock:
                seen["connections"] += 1
                seen["requests"] += bool(data)

def bind(at):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(at)
    s.listen(64)
    threading.Thread(target=serve, args=(s,), daemon=True).start()
    return s

if mode == "hold":
    os.rename(path, aside)
    listener = bind(path)
    print(json.dumps({"pid": os.getpid(), "uid": os.getuid()}), flush=True)
    sys.stdin.readline()
    listener.close()
    os.unlink(path)
    os.rename(aside, path)
else:  # race: exchange the two sockets at the path, atomically and as fast as it can, until told to stop
    # renameat2(RENAME_EXCHANGE) swaps the two directory entries in one step: the path always holds
    # a socket, the daemon's (owned by the engine's uid) or ours, alternating every few microseconds.
    # An engine whose lstat lands on the daemon's file and whose connect lands on ours meets the
    # connect-time check; a plain rename race almost never lands there (0 connections in 60 loads).
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    AT_FDCWD, RENAME_EXCHANGE = -100, 2
    ours = path + ".ours"
    listener = bind(ours)
    stop = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.readline(), stop.set()), daemon=True).start()
    print(json.dumps({"pid": os.getpid(), "uid": os.getuid()}), flush=True)
    a, b = path.encode(), ours.encode()
    while not stop.is_set():
        for _ in range(200):
            if libc.renameat2(AT_FDCWD, a, AT_FDCWD, b, RENAME_EXCHANGE) != 0:
                raise OSError(ctypes.get_errno(), "renameat2(RENAME_EXCHANGE)")
            seen["swaps"] += 1
        time.sleep(0)  # let the serving thread take the GIL
    if seen["swaps"] % 2:  # put the daemon's socket back at its path
        libc.renameat2(AT_FDCWD, a, AT_FDCWD, b, RENAME_EXCHANGE)
    time.sleep(0.3)  # connections still queued are accepted and counted
    listener.close()
    os.unlink(ours)
time.sleep(0.3)
with lock:
    print(json.dumps(seen), flush=True)
"""


@pytest.fixture(scope="module")
def shared_dir():
    if os.getuid() != 0:
        pytest.skip("needs root to run the attacker as uid 65534 (setpriv)")
    if not shutil.which("setpriv"):
        pytest.skip("setpriv (util-linux) is not installed")
    d = Path(tempfile.mkdtemp(prefix="wf-peer-", dir="/tmp"))
    os.chown(d, 0, OTHER)
    os.chmod(d, 0o2770)  # group-shared, as the guide allows for --weight-cache-socket-dir
    yield d
    for p in d.iterdir():
        p.unlink()
    d.rmdir()


@pytest.fixture(scope="module")
def daemon(fault_procs, tiny_model, shared_dir):
    return fault_procs.preload(tiny_model, "--no-enable-autotune", "--weight-cache-socket-dir", str(shared_dir))


@pytest.fixture(scope="module")
def sock(daemon, shared_dir):
    return shared_dir / socket_name(device_identity("cpu", 0))


@pytest.fixture(scope="module")
def cfg(tiny_model):
    return EngineConfig.build(str(tiny_model), "auto", None, "cpu")


def attacker(sock: Path, mode: str) -> tuple[subprocess.Popen, dict]:
    proc = subprocess.Popen(["setpriv", "--reuid", str(OTHER), "--regid", str(OTHER), "--clear-groups",
                             sys.executable, "-c", ATTACKER, str(sock), mode],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    first = proc.stdout.readline()
    assert first, proc.stderr.read()
    return proc, json.loads(first)


def finish(proc: subprocess.Popen) -> dict:
    proc.stdin.write("\n")
    proc.stdin.flush()
    seen = json.loads(proc.stdout.readline() or "null")
    assert proc.wait(30) == 0, proc.stderr.read()
    return seen


def maps(cfg, shared_dir) -> None:
    """The daemon served all along: once the attacker is gone, an engine maps its weights."""
    _, report, lease = load_weights(cfg, "ipc_cache", LoaderConfig(socket_dir=str(shared_dir), fallback=False,
                                                                    state_timeout_s=10))
    assert report.source == "the weight cache (zero_copy)"
    lease.close()


def test_a_listener_of_another_uid_at_the_socket_path_is_refused_before_any_request(daemon, sock, cfg, shared_dir):
    TALLY.fault("a listener of another uid swapped in at the daemon socket path")
    maps(cfg, shared_dir)
    proc, who = attacker(sock, "hold")
    try:
        assert who["uid"] == OTHER
        # The swap landed between the engine's lstat and its connect: the file it checked was its
        # own uid's. Made deterministic by giving the attacker's socket file to that uid.
        os.chown(sock, os.getuid(), os.getgid())
        t0 = time.monotonic()
        _, report, lease = load_weights(cfg, "ipc_cache", LoaderConfig(socket_dir=str(shared_dir)))
        refused = REASONS["untrusted_peer"].format(path=sock, pid=who["pid"], uid=OTHER, owner=os.getuid(),
                                                   own=os.getuid())
        assert (report.source, report.fallback_reason, lease) == ("disk", refused, None)
        assert time.monotonic() - t0 < 30
        # Without the swap the attacker's own file is refused before connecting, as before.
        os.chown(sock, OTHER, OTHER)
        _, report, _ = load_weights(cfg, "ipc_cache", LoaderConfig(socket_dir=str(shared_dir)))
        assert report.fallback_reason == REASONS["unsafe_socket"].format(
            path=sock, error=f"{sock} is owned by uid {OTHER}, not {os.getuid()}")
    finally:
        seen = finish(proc)
    assert seen["connections"] == 1 and seen["requests"] == 0, seen  # the engine connected, sent nothing
    maps(cfg, shared_dir)


def race(cfg, shared_dir, sock, landed) -> tuple[dict, dict]:
    """Engines load while the attacker exchanges its socket with the daemon's: (what the attacker
    saw, the loads' outcomes by kind). At least RACE_LOADS loads, then on until ``landed(outcomes)``
    says the race reached the engine ENOUGH times, within RACE_MAX_LOADS and RACE_SECONDS."""
    proc, who = attacker(sock, "race")
    outcomes: dict[str, int] = {}
    t0 = time.monotonic()
    try:
        for n in range(RACE_MAX_LOADS):
            if time.monotonic() - t0 > RACE_SECONDS or (n >= RACE_LOADS and landed(outcomes) >= ENOUGH):
                break
            _, report, lease = load_weights(cfg, "ipc_cache", LoaderConfig(socket_dir=str(shared_dir)))
            if lease is not None:
                lease.close()
            what = report.fallback_reason or report.source
            kind = next((k for k, prefix in RACE_OUTCOMES.items() if what.startswith(prefix)), what)
            if kind == "untrusted_peer" and f"(pid {who['pid']}) runs as uid {OTHER}," not in what:
                kind = "untrusted_peer (the daemon answered, the owner read was the attacker's file)"
            outcomes[kind] = outcomes.get(kind, 0) + 1
    finally:
        seen = finish(proc)
    print(f"race: {seen['swaps']} swaps, {sum(outcomes.values())} loads in {time.monotonic() - t0:.1f} s: {outcomes}; "
          f"attacker accepted {seen['connections']} connection(s), got {seen['requests']} request(s)")
    return seen, outcomes


# What a load during the race may end in, by the start of its report.
RACE_OUTCOMES = {"zero_copy": "the weight cache (zero_copy)",
                 "untrusted_peer": REASONS["untrusted_peer"].split("{")[0],
                 "unsafe_socket": REASONS["unsafe_socket"].split("{")[0],
                 "no_socket": REASONS["no_socket"].split("{")[0],
                 "refused": REASONS["refused"].split("{")[0]}


def test_engines_never_send_a_request_to_a_swapping_listener_of_another_uid(daemon, sock, cfg, shared_dir):
    TALLY.fault("a listener of another uid racing the daemon socket")
    seen, outcomes = race(cfg, shared_dir, sock, landed=lambda o: o.get("untrusted_peer", 0))
    assert set(outcomes) - {"untrusted_peer (the daemon answered, the owner read was the attacker's file)"} \
        <= set(RACE_OUTCOMES), outcomes
    # The race reached the connect-time check: engines connected to the attacker (its accept ran),
    # each such load was refused as untrusted_peer naming the attacker, and none sent a request.
    assert seen["connections"] >= 1, (seen, outcomes)
    assert outcomes.get("untrusted_peer", 0) == seen["connections"], (seen, outcomes)
    assert seen["requests"] == 0, (seen, outcomes)
    maps(cfg, shared_dir)


def test_the_race_sends_requests_to_the_attacker_when_the_connect_time_check_is_gone(daemon, sock, cfg, shared_dir,
                                                                                      monkeypatch):
    """Negative control of the test above: the same race against a copy of the engine's client whose
    connect-time check is removed must hand the attacker requests, or the race proves nothing."""
    source = Path(client_module.__file__).read_text()
    check = "if self.peer_uid != owner or self.peer_uid not in trusted_uids():"
    assert source.count(check) == 1, "the connect-time check moved: update this control"
    broken = types.ModuleType("client_without_peer_check")
    exec(compile(source.replace(check, "if False:"), "client_without_peer_check", "exec"), broken.__dict__)
    monkeypatch.setattr(ipc_cache, "CacheClient", broken.CacheClient)
    seen, outcomes = race(cfg, shared_dir, sock,
                          landed=lambda o: sum(n for k, n in o.items() if k not in RACE_OUTCOMES))
    assert seen["requests"] >= 1, (seen, outcomes)
    monkeypatch.undo()
    maps(cfg, shared_dir)
