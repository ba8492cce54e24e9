"""A standby daemon (`wcache preload --weight-cache-standby`): warm and untouching while it waits,
then a takeover that adopts the running engine's arena.

* Beside a running daemon it says it stands by, once its rank interpreter has imported torch, and
  has done nothing else: no lock held by its rank, no record written, no socket bound.
* SIGKILL of the active daemon while a zero_copy engine maps: the standby takes over and adopts
  the engine's arena (the same memfd, no disk load); engines then answer as a disk load does.
* An engine that offers late (it notices the death after the standby took over) is still adopted.
* Two standbys: one takes over, the other stands by on, and takes over when that one dies.
* A tensor-parallel standby prewarms every rank, and those ranks take over.
* A waiting standby stopped with SIGTERM exits 0 and leaves no process; one whose launcher is
  SIGKILLed leaves no rank process.
"""

from __future__ import annotations

import os
import signal
import socket
import time
from pathlib import Path

import pytest
from itest import alive, call, default_socket, memfd_inode, rank_pids, wait_until
from procs import complete, engine_pid, free_port
from wcache.core.checkpoint import make_checkpoint
from wcache.core.device import device_identity
from wcache.wire.sockets import socket_name
from wcache.daemon import arena_record
from wcache.errors import ADOPTED, NO_OFFER_AFTER_TAKEOVER, STANDBY_STOPPED, STANDING_BY, TAKING_OVER
from wcache.daemon.launcher import READY
from wcache.daemon.rank import OFFER_AFTER_TAKEOVER_S

NO_TUNE = "--no-enable-autotune"
STANDBY = (NO_TUNE, "--weight-cache-standby")
ZERO_COPY = ("--load-format", "ipc_cache", NO_TUNE)
LOADED = "Rank 0 loaded 27 tensors"


def opened_by(pid: int, path: Path) -> bool:
    """Whether ``pid`` has ``path`` open (a flock lives on an open file, whoever took it)."""
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}") == str(path):
                return True
        except OSError:
            continue
    return False


def flock_waiters(lock: Path) -> set[int]:
    """The pids /proc/locks shows blocked on a FLOCK of ``lock``'s inode (its "->" lines)."""
    ino = os.stat(lock).st_ino
    out = set()
    for line in Path("/proc/locks").read_text().splitlines():
        f = line.split()
        if f[1] == "->" and f[2] == "FLOCK" and int(f[6].split(":")[2]) == ino:
            out.add(int(f[5]))
    return out


def imported_torch(pid: int) -> bool:
    return "libtorch" in Path(f"/proc/{pid}/maps").read_text()


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def standing_by(procs, model, sock: Path):
    standby = procs.preload(model, *STANDBY, ready=False)
    standby.wait_for_log(STANDING_BY.format(path=sock), timeout=120)
    return standby


def test_a_standby_waits_warm_and_touches_nothing(procs, tiny_model, wcache_env):
    first = procs.preload(tiny_model, NO_TUNE)
    sock = default_socket(wcache_env)
    [active] = rank_pids(first.pid)
    recorded = arena_record.record_path(sock).read_bytes()
    inode = os.lstat(sock).st_ino
    listing = sorted(os.listdir(sock.parent))

    health = free_port()
    standby = procs.preload(tiny_model, *STANDBY, "--weight-cache-health-port", str(health), ready=False)
    standby.wait_for_log(STANDING_BY.format(path=sock), timeout=120)
    [rank] = rank_pids(standby.pid)
    # the rank has paid its interpreter and torch; its launcher, which only plans and waits, imports no torch
    assert imported_torch(rank) and not imported_torch(standby.pid)
    with pytest.raises(ConnectionRefusedError):  # its health port is not bound yet
        socket.create_connection(("127.0.0.1", health), timeout=5).close()
    lock = Path(str(sock) + ".lock")
    assert opened_by(active, lock) and not opened_by(rank, lock)  # the rank was handed no lock
    assert flock_waiters(lock) == {standby.pid}  # its launcher waits for it, holding none
    assert "Rank 0" not in standby.log() and READY not in standby.log()
    assert arena_record.record_path(sock).read_bytes() == recorded
    assert os.lstat(sock).st_ino == inode and sorted(os.listdir(sock.parent)) == listing
    assert call(sock, "get_memory")["ok"]
    print(f"standby host memory: launcher {rss_mib(standby.pid):.0f} MiB, rank {rss_mib(rank):.0f} MiB (RSS)")

    assert standby.stop(signal.SIGTERM, timeout=30) == 0
    assert STANDBY_STOPPED.format(signal="SIGTERM") in standby.log() and "Traceback" not in standby.log()
    wait_until(lambda: not alive(rank), 30, f"the standby's rank {rank} to exit")
    assert call(sock, "get_memory")["ok"] and rank_pids(first.pid) == [active]


def test_a_standby_takes_over_and_adopts_the_running_engines_arena(procs, tiny_model, wcache_env):
    first = procs.preload(tiny_model, NO_TUNE)
    sock = default_socket(wcache_env)
    inode = memfd_inode(rank_pids(first.pid)[0])
    engine = procs.serve(tiny_model, *ZERO_COPY)
    answer = complete(engine.port, "take over")
    standby = standing_by(procs, tiny_model, sock)
    [rank] = rank_pids(standby.pid)

    t0 = time.monotonic()
    first.kill_group()  # the launcher and its rank at once, as a crash would
    standby.wait_for_log(READY, timeout=60)
    print(f"standby takeover: SIGKILL of the active daemon to READY in {time.monotonic() - t0:.2f} s")
    log = standby.log()
    assert TAKING_OVER.format(path=sock) in log
    assert ADOPTED.split("{mib")[0].format(rank=0, pid=engine_pid(engine.pid), n=27) in log and LOADED not in log, log
    assert rank_pids(standby.pid) == [rank] and memfd_inode(rank) == inode  # the prewarmed rank, the engine's memory

    disk = procs.serve(tiny_model, NO_TUNE)
    other = procs.serve(tiny_model, *ZERO_COPY)
    assert "Mapped 27 tensors from the weight cache daemon (zero_copy mode)" in other.log()
    for prompt in ("take over", "a standby"):
        expected = complete(disk.port, prompt)["choices"]
        assert complete(other.port, prompt)["choices"] == expected
        assert complete(engine.port, prompt)["choices"] == expected
    assert complete(engine.port, "take over")["choices"] == answer["choices"]


def test_a_standby_waits_for_an_engine_that_offers_late(procs, tiny_model, wcache_env):
    """The engine notices its daemon's death only after the standby took over (it is stopped with
    SIGSTOP across the kill and resumed LATE_S later): the standby waits for its offer, within
    OFFER_AFTER_TAKEOVER_S, instead of loading from disk."""
    late_s = OFFER_AFTER_TAKEOVER_S / 4
    first = procs.preload(tiny_model, NO_TUNE)
    sock = default_socket(wcache_env)
    engine = procs.serve(tiny_model, *ZERO_COPY)
    standby = standing_by(procs, tiny_model, sock)
    held = engine_pid(engine.pid)  # the process whose rank holds the lease: the core with two processes
    os.kill(held, signal.SIGSTOP)
    try:
        first.kill_group()
        standby.wait_for_log(TAKING_OVER.format(path=sock), timeout=30)
        time.sleep(late_s)  # its rank is at the offers by now, and finds none
    finally:
        os.kill(held, signal.SIGCONT)
    standby.wait_for_log(READY, timeout=60)
    log = standby.log()
    assert ADOPTED.split("{mib")[0].format(rank=0, pid=held, n=27) in log and LOADED not in log, log
    assert complete(engine.port, "late")["choices"] == complete(procs.serve(tiny_model, NO_TUNE).port, "late")["choices"]


def test_of_two_standbys_one_takes_over_and_the_other_stands_by_on(procs, tiny_model, wcache_env):
    first = procs.preload(tiny_model, NO_TUNE)
    sock = default_socket(wcache_env)
    standbys = [standing_by(procs, tiny_model, sock) for _ in range(2)]

    first.kill_group()
    wait_until(lambda: any(READY in s.log() for s in standbys), 60, "a standby to take over")
    [winner] = [s for s in standbys if READY in s.log()]
    [waiting] = [s for s in standbys if s is not winner]
    # No engine mapped the arena: the winner waited its bound for an offer, then loaded from disk.
    assert NO_OFFER_AFTER_TAKEOVER.format(rank=0, seconds=OFFER_AFTER_TAKEOVER_S) in winner.log()
    assert LOADED in winner.log() and call(sock, "get_memory")["ok"]
    time.sleep(1.0)
    assert waiting.proc.poll() is None and READY not in waiting.log() and "Rank 0" not in waiting.log()

    winner.kill_group()
    waiting.wait_for_log(READY, timeout=60)
    assert TAKING_OVER.format(path=sock) in waiting.log() and call(sock, "get_memory")["ok"]


@pytest.fixture(scope="module")
def model32(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("standby") / "tiny32", "tiny", dtype="float32")


def test_a_tp2_standby_prewarms_every_rank_and_takes_over_with_them(procs, model32, wcache_env):
    first = procs.preload(model32, "-tp", "2", NO_TUNE)
    d = default_socket(wcache_env).parent
    socks = [d / socket_name(device_identity("cpu", i)) for i in (0, 1)]
    standby = procs.preload(model32, "-tp", "2", *STANDBY, ready=False)
    standby.wait_for_log(STANDING_BY.format(path=socks[0]), timeout=120)
    ranks = rank_pids(standby.pid)
    assert len(ranks) == 2 and all(imported_torch(p) for p in ranks)  # both interpreters paid, not only the first
    assert not any(opened_by(p, Path(f"{s}.lock")) for p in ranks for s in socks)

    first.kill_group()
    standby.wait_for_log(READY, timeout=60)
    assert f"{READY} (2 rank(s)" in standby.log() and sorted(rank_pids(standby.pid)) == sorted(ranks)
    assert all(call(s, "get_memory")["ok"] for s in socks)


def test_a_stopped_standby_leaves_no_process(procs, tiny_model, wcache_env):
    first = procs.preload(tiny_model, NO_TUNE)
    sock = default_socket(wcache_env)
    # SIGKILL of the launcher: its prewarmed rank reads end-of-file on its spec socket and leaves.
    standby = standing_by(procs, tiny_model, sock)
    [rank] = rank_pids(standby.pid)
    os.kill(standby.pid, signal.SIGKILL)
    standby.proc.wait(10)
    wait_until(lambda: not alive(rank), 30, f"rank {rank} to exit after its standby launcher was killed")

    # SIGINT (Ctrl-C) while waiting: exit 0 as for SIGTERM, rank gone.
    standby = standing_by(procs, tiny_model, sock)
    [rank] = rank_pids(standby.pid)
    assert standby.stop(signal.SIGINT, timeout=30) == 0
    assert STANDBY_STOPPED.format(signal="SIGINT") in standby.log() and "Traceback" not in standby.log()
    assert not alive(rank)  # the launcher killed it before it exited
    assert call(sock, "get_memory")["ok"] and first.proc.poll() is None
