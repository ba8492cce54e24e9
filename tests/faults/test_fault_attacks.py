"""The attacks of issue sec-2, each mounted for real against a live daemon or engine (loopback and
Unix sockets only, bounded in time and count), each ending with the attack failing: a forged
hand-back, a descriptor flood, EMFILE on accept, memory amplification, unread answers piling
descriptors in flight, a second daemon on a live socket, slow frames, silent offers, misused lock
and socket paths, and a hostile HTTP client. What each costs the target (descriptors, RSS, threads,
latency) is measured and shown in docs/faults.md (attacklib.figure).
"""

from __future__ import annotations

import array
import json
import mmap
import os
import re
import resource
import socket
import stat
import struct
import tempfile
import threading
import time
from pathlib import Path

import pytest
import torch
from attacklib import CLOSE_SLACK_S, Peak, figure, fds, rss_mib, threads, timed
from faultlib import call, frame, settle, split_replies, wait_until
from wcache.core.config import EngineConfig
from wcache.core.device import device_identity
from wcache.core.disk import load_processed
from wcache.core.fingerprint import cache_key
from wcache.daemon import arena_hash, arena_record
from wcache.daemon.rank import ACCEPT_FAILED_LOG, CLIENT_IO_LOG, REQUEST_TIMEOUT_S, UNREAD_LOG
from wcache.errors import ARENA_NOT_RECORDED, ARENA_RECORD_UNSAFE, ARENA_RECORDED, DAEMON_ERRORS, OFFER_SKIPPED, DaemonLockError, SocketSecurityError
from wcache.wire.handback import ASK_BUDGET_S, OFFER_PREFIX
from wcache.wire.protocol import MAX_FDS, MAX_FRAME_BYTES, recv_frame, reply, request, send_frame
from wcache.wire.sockets import socket_name
from wcache.wire.transports.memfd import MemfdArena


NO_TUNE = "--no-enable-autotune"
LOADED = "Rank 0 loaded "
SOCK_NAME = socket_name(device_identity("cpu", 0))


@pytest.fixture(scope="module")
def cfg(tiny_model):
    return EngineConfig.build(str(tiny_model), "auto", None, "cpu")


@pytest.fixture(scope="module")
def daemon(fault_procs, tiny_model):
    return fault_procs.preload(tiny_model, NO_TUNE)


def private_dir(_tmp_path: Path, name: str) -> Path:
    """A short 0700 socket directory under the module's private TMPDIR (pytest's tmp_path is too long
    for a Unix socket path)."""
    return Path(tempfile.mkdtemp(prefix=name[:8] + "-"))


def get_memory_latency(sock: Path) -> float:
    seconds, answer = timed(call, sock, "get_memory", timeout=20)
    assert answer["ok"] is True, answer
    return seconds


def served_bytes(sock: Path, key: dict) -> bytes:
    """The bytes of the arena a daemon serves (a copy-mode get_state, the memfd mapped here)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(20)
        s.connect(str(sock))
        send_frame(s, request("get_state", key=key, mode="copy"))
        answer, got = recv_frame(s)
    assert answer["ok"], answer
    try:
        with mmap.mmap(got[0], answer["arena"]["size"], prot=mmap.PROT_READ) as m:
            return bytes(m)
    finally:
        for fd in got:
            os.close(fd)


# -- 1. a forged hand-back ---------------------------------------------------------------------------
class ForgedOffer:
    """An offer as any process of the daemon's uid can plant one: a sealed memfd of altered
    weights, the right key, socket name, device and manifest, and (worst case) the real arena id."""

    def __init__(self, path: Path, state: dict, fd: int):
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(str(path))
        self.listener.listen(4)
        self.listener.settimeout(0.2)
        self.state, self.fd, self.stop = state, fd, threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self.listener.accept()
            except TimeoutError:
                continue
            with conn:
                recv_frame(conn)
                send_frame(conn, reply(True, **self.state), [self.fd])

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        self.listener.close()


@pytest.mark.slow  # starts daemons (or waits out a read timeout): tens of seconds
def test_a_forged_hand_back_is_never_adopted(fault_procs, tiny_model, cfg, tmp_path):
    d = private_dir(tmp_path, "forged")
    sock = d / SOCK_NAME
    first = fault_procs.preload(tiny_model, NO_TUNE, "--weight-cache-socket-dir", str(d))
    key = cache_key(cfg)
    genuine = served_bytes(sock, key)
    real_id = call(sock, "get_state", key=key, mode="copy")["arena"]["id"]
    assert re.search(re.escape(ARENA_RECORDED.split(" (")[0]).replace(r"\{rank\}", "0").replace(r"\{kind\}", "memfd"),
                     first.log()), first.log()
    first.stop()

    # The record a daemon keeps of what it packed: outside the socket directory, 0600 in 0700.
    record = arena_record.record_path(sock)
    assert record.exists() and d not in record.parents
    assert stat.S_IMODE(os.stat(record).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(record.parent).st_mode) == 0o700

    weights = load_processed(cfg, False)
    weights.tensors["norm.weight"].add_(1.0)  # the forgery: altered weights, sealed like the real ones
    forged = MemfdArena.pack(weights)
    state = {"key": key, "socket": SOCK_NAME, "arena": dict(forged.descriptor(), id=real_id),
             "manifest": {"groups": forged.layout.groups}, "aliases": weights.aliases, "attrs": weights.attrs,
             "device_id": device_identity("cpu", 0)}
    offer = ForgedOffer(d / f"{OFFER_PREFIX}forged0000000000.sock", state, forged.fd)
    try:
        seconds, again = timed(fault_procs.preload, tiny_model, NO_TUNE, "--weight-cache-socket-dir", str(d))
        log = again.log()
        assert OFFER_SKIPPED.format(rank=0, offer=offer.listener.getsockname(), why=ARENA_NOT_RECORDED) in log, log
        assert "adopted the arena" not in log and LOADED in log
        assert served_bytes(sock, key) == genuine  # the checkpoint's bytes, not the forgery's
    finally:
        offer.close()
        forged.close()
    figure("forged hand-back", start_s=seconds, adopted=False)


def test_hashing_an_arena_on_the_cpu(tmp_path):
    """The keyed hash a vmm_fd adoption checks before serving (daemon/arena_hash.py; on a GPU it runs
    on the GPU), here on the CPU: 256 MiB."""
    secret = arena_hash.new_secret()
    t = torch.randint(0, 255, (256 << 20,), dtype=torch.uint8)
    seconds, digest = timed(arena_hash.keyed_digest, t, secret)
    assert digest == arena_hash.keyed_digest(t.clone(), secret) and len(digest) == 2
    t[12345] ^= 1
    assert arena_hash.keyed_digest(t, secret) != digest
    figure("hashing an arena (CPU)", mib=256, seconds=seconds, mib_per_s=256 / seconds)


def flood_once(sock: Path, spare: list[int]) -> dict | None:
    """One connection that sends its frame a byte at a time, 8 descriptors on every byte."""
    data = frame({"v": 1, "op": "get_memory"})
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(20)
        s.connect(str(sock))
        try:
            for b in data:
                s.sendmsg([bytes([b])], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", spare))])
        except (BrokenPipeError, ConnectionResetError):
            pass
        buf = bytearray()
        try:
            while chunk := s.recv(65536):
                buf += chunk
        except ConnectionResetError:
            pass
    replies = split_replies(bytes(buf))
    return replies[0] if replies else None


def test_a_descriptor_flood_is_refused_per_frame_and_engines_are_served(daemon, sock, rank):
    base = fds(rank)
    spare = [os.open("/dev/null", os.O_RDONLY) for _ in range(MAX_FDS)]
    answers, latencies = [], []
    stop = threading.Event()

    def flooder():
        while not stop.is_set():
            answers.append(flood_once(sock, spare))

    try:
        with Peak(rank) as peak:
            workers = [threading.Thread(target=flooder, daemon=True) for _ in range(32)]
            for w in workers:
                w.start()
            deadline = time.monotonic() + 6
            while time.monotonic() < deadline:
                latencies.append(get_memory_latency(sock))
            stop.set()
            for w in workers:
                w.join(30)
    finally:
        for fd in spare:
            os.close(fd)
    refused = [a for a in answers if a and a.get("error") == "protocol"]
    assert refused and all(f"more than {MAX_FDS} file descriptors" in a["message"] for a in refused)
    assert len(refused) == len(answers)
    assert max(latencies) < 5, latencies
    assert peak.fds <= base + 32 * (1 + 2 * MAX_FDS) + 16  # per frame, at most 8 (+8 in the last segment)
    assert settle(rank, base) == 0
    assert "Too many open files" not in daemon.log()
    figure("descriptor flood", connections=len(answers), flooders=32, fds_before=base, fds_peak=peak.fds,
           engine_latency_max_s=max(latencies))


def test_accept_backs_off_on_emfile_and_logs_once(daemon, sock, rank):
    base = fds(rank)
    soft, hard = resource.prlimit(rank, resource.RLIMIT_NOFILE)
    idle = []
    lines_before = daemon.log().count(ACCEPT_FAILED_LOG.split(" (")[0])
    try:
        resource.prlimit(rank, resource.RLIMIT_NOFILE, (base + 8, hard))
        for _ in range(40):  # idle connections: the daemon accepts 8, then its table is full
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(str(sock))
            idle.append(s)
        with Peak(rank) as peak:
            time.sleep(3)
        log = daemon.log()
        lines = log.count(ACCEPT_FAILED_LOG.split(" (")[0]) - lines_before
        assert 1 <= lines <= 2, lines  # once per 10 s, not ~100,000 a second
        for s in idle:
            s.close()
        idle.clear()
        wait_until(lambda: fds(rank) <= base + 1, 20, "the idle connections to close")
        resource.prlimit(rank, resource.RLIMIT_NOFILE, (soft, hard))
        latency = get_memory_latency(sock)
        assert latency < 3
    finally:
        for s in idle:
            s.close()
        resource.prlimit(rank, resource.RLIMIT_NOFILE, (soft, hard))
    figure("EMFILE on accept", seconds=3, log_lines=lines, threads_peak=peak.threads,
           engine_latency_after_s=latency)


# -- 4. memory ----------------------------------------------------------------------------------------
def send_raw(sock: Path, data: bytes, timeout: float = 30) -> list[dict]:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        s.connect(str(sock))
        try:
            s.sendall(data)
            s.shutdown(socket.SHUT_WR)
        except (BrokenPipeError, ConnectionResetError):
            pass
        buf = bytearray()
        try:
            while chunk := s.recv(1 << 16):
                buf += chunk
        except ConnectionResetError:
            pass
    return split_replies(bytes(buf))


def test_memory_amplification_is_refused_before_parsing(daemon, sock, rank):
    body = b'{"v":1,"op":"get_memory","x":[' + b"[]," * ((MAX_FRAME_BYTES - 64) // 3) + b"[]]}"
    data = frame(body)
    before = rss_mib(rank)
    answers, latencies = [], []
    with Peak(rank) as peak:
        workers = [threading.Thread(target=lambda: answers.extend(send_raw(sock, data)), daemon=True)
                   for _ in range(4)]
        t0 = time.perf_counter()
        for w in workers:
            w.start()
        while any(w.is_alive() for w in workers):
            latencies.append(get_memory_latency(sock))
        refused_in = time.perf_counter() - t0
    # Refused unparsed; a frame that arrives while two others are held is refused before it is read.
    # A busy refusal may be lost to the reset of a peer still sending 16 MiB; each one is logged.
    busy = daemon.log().count("(busy): frames in flight hold")
    assert len(answers) + busy >= 4 and answers and all(
        a["message"].startswith(("frame holds ", "the daemon holds ")) for a in answers), (answers, busy)
    assert peak.rss - before < 200, (before, peak.rss)  # was ~400 MiB per connection
    deep = frame(b'{"v":1,"op":"get_state","mode":"copy","key":{"dtype":' + b"[" * 500 + b"]" * 500 + b"}}")
    seconds, [answer] = timed(send_raw, sock, deep)
    assert answer["error"] == "protocol" and "nests deeper" in answer["message"]
    assert seconds < 2
    figure("memory amplification", connections=4, frame_mib=16, rss_before_mib=before, rss_peak_mib=peak.rss,
           refused_in_s=refused_in, engine_latency_max_s=max(latencies or [0.0]), deep_key_answered_in_s=seconds)


def test_large_frames_in_flight_are_bounded_in_bytes(daemon, sock, rank):
    """Connections that send 16 MiB frames slowly hold what they sent: past IN_FLIGHT_BYTES the
    next large frame is refused at once with ``busy``, and small requests (engines) still pass."""
    header = struct.pack(">Q", MAX_FRAME_BYTES)
    held = []
    before = rss_mib(rank)
    try:
        with Peak(rank) as peak:
            for _ in range(2):  # 2 x 16 MiB x 4 = the 128 MiB budget
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                s.connect(str(sock))
                s.sendall(header + b'{"v":1,"op":"get_memory","p":"' + b"x" * (8 << 20))
                held.append(s)
            time.sleep(0.5)
            [answer] = send_raw(sock, header + b"{", timeout=10)
            latency = get_memory_latency(sock)
    finally:
        for s in held:
            s.close()
    assert answer["error"] == "busy" and answer["message"].startswith("the daemon holds "), answer
    assert latency < 3
    figure("large frames in flight", held_connections=2, rss_before_mib=before, rss_peak_mib=peak.rss,
           engine_latency_s=latency)


def read_all(s: socket.socket) -> tuple[list[dict], list[int]]:
    """Every frame a peer sent until EOF, and the descriptors that came with them (closed here)."""
    buf, got = bytearray(), []
    while True:
        try:
            data, anc, _, _ = s.recvmsg(1 << 16, socket.CMSG_SPACE(4 * MAX_FDS))
        except ConnectionResetError:
            break
        for level, kind, payload in anc:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                got.extend(array.array("i", payload[: len(payload) - len(payload) % 4]))
        if not data:
            break
        buf += data
    for fd in got:
        os.close(fd)
    return split_replies(bytes(buf)), got


# -- 6. unread answers ---------------------------------------------------------------------------------
def test_unread_answers_with_descriptors_are_bounded_and_logged(daemon, sock, rank, cfg):
    key = cache_key(cfg)
    ask = frame(json.dumps(request("get_state", key=key, mode="copy")).encode())
    base = fds(rank)
    greedy = []
    try:
        with Peak(rank) as peak:
            for _ in range(100):  # each asks 20 times and never reads
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                s.settimeout(10)
                s.connect(str(sock))
                try:
                    s.sendall(ask * 20)
                except (BrokenPipeError, ConnectionResetError):
                    pass
                greedy.append(s)
            wait_until(lambda: daemon.log().count("has not read the answer") >= 100, 30, "100 refusals")
            seconds, answer = timed(call, sock, "get_state", key=key, mode="copy", timeout=20)
        # What a greedy connection got: one answer with one descriptor, then the refusal, then EOF.
        for s in greedy[:5]:
            replies, got = read_all(s)
            assert [r.get("ok") for r in replies] == [True, False] and len(got) == 1, replies[-1:]
            assert replies[1]["error"] == "unread" and replies[1]["message"] == DAEMON_ERRORS["unread"]
    finally:
        for s in greedy:
            s.close()
    assert answer["ok"] is True
    unread_line = re.escape(UNREAD_LOG).replace("%d", r"\d+")
    assert len(re.findall(unread_line, daemon.log())) >= 100
    assert settle(rank, base) == 0
    figure("unread answers", connections=100, requests_each=20, fds_before=base, fds_peak=peak.fds,
           engine_get_state_s=seconds)


# -- 7. two daemons ---------------------------------------------------------------------------------------
@pytest.mark.slow  # starts daemons (or waits out a read timeout): tens of seconds
def test_a_live_daemon_keeps_its_socket_when_its_lock_is_removed(fault_procs, tiny_model, tmp_path):
    d = private_dir(tmp_path, "two")
    sock = d / SOCK_NAME
    first = fault_procs.preload(tiny_model, NO_TUNE, "--weight-cache-socket-dir", str(d))
    inode = os.lstat(sock).st_ino
    Path(str(sock) + ".lock").unlink()  # what a tmp cleaner does
    second = fault_procs.preload(tiny_model, NO_TUNE, "--weight-cache-socket-dir", str(d), ready=False)
    assert second.exit_code(120) == 2
    assert DaemonLockError.LIVE_SOCKET.format(path=sock) in second.log()
    assert os.lstat(sock).st_ino == inode and call(sock, "get_memory")["ok"]
    first.stop()


# -- 8. paths, deadlines, offers, rehash --------------------------------------------------------------------
@pytest.mark.slow  # starts daemons (or waits out a read timeout): tens of seconds
def test_a_symlinked_lock_and_a_file_as_socket_dir_have_their_own_messages(fault_procs, tiny_model, tmp_path):
    d = private_dir(tmp_path, "locklink")
    sock = d / SOCK_NAME
    os.symlink(tmp_path / "elsewhere", str(sock) + ".lock")
    p = fault_procs.preload(tiny_model, NO_TUNE, "--weight-cache-socket-dir", str(d), ready=False)
    assert p.exit_code(120) == 2
    assert DaemonLockError.SYMLINK.format(path=str(sock) + ".lock") in p.log()
    assert "Another weight cache daemon already owns" not in p.log()
    e = private_dir(tmp_path, "lockdir")
    os.mkdir(e / (SOCK_NAME + ".lock"))  # a directory cannot be opened for writing
    r = fault_procs.preload(tiny_model, NO_TUNE, "--weight-cache-socket-dir", str(e), ready=False)
    assert r.exit_code(120) == 2
    assert DaemonLockError.CANNOT_OPEN.format(path=e / (SOCK_NAME + ".lock"), error="Is a directory") in r.log()
    f = tmp_path / "a-file"
    f.write_text("")
    q = fault_procs.preload(tiny_model, NO_TUNE, "--weight-cache-socket-dir", str(f), ready=False)
    assert q.exit_code(120) == 2
    assert SocketSecurityError.NOT_A_DIR.format(dir=f) in q.log()


@pytest.mark.slow
def test_a_frame_sent_a_byte_a_second_is_cut_at_the_total_deadline(daemon, sock):
    data = frame({"v": 1, "op": "get_memory", "pad": "x" * 100})
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.connect(str(s_path := sock))
        t0 = time.monotonic()
        closed = None
        for b in data:
            try:
                s.sendall(bytes([b]))
            except (BrokenPipeError, ConnectionResetError):
                closed = time.monotonic() - t0
                break
            s.settimeout(1.0)
            try:
                if s.recv(1 << 16) == b"":
                    closed = time.monotonic() - t0
                    break
            except TimeoutError:
                pass
            if time.monotonic() - t0 > REQUEST_TIMEOUT_S + 10:
                break
    assert closed is not None and closed <= REQUEST_TIMEOUT_S + 3, closed  # was 82 s for this frame
    line = re.escape(CLIENT_IO_LOG).replace("%d", r"\d+").replace("%s", "frame not complete within")
    assert re.search(line, daemon.log()), daemon.log()[-2000:]
    assert call(s_path, "get_memory")["ok"]
    figure("a frame at 1 byte a second", frame_bytes=len(data), closed_after_s=closed)


class SilentOffers:
    """Offers that accept and never answer. ``asked_s``: from the daemon's first connection to the
    moment it hung up on the last one, the time the offers held its start."""

    def __init__(self, d: Path, n: int):
        self.listeners, self.held, self.stop = [], [], threading.Event()
        self.accepted: list[float] = []
        self.hung_up: list[float] = []
        for i in range(n):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.bind(str(d / f"{OFFER_PREFIX}silent{i:010d}.sock"))
            s.listen(4)
            s.settimeout(0.01)
            self.listeners.append(s)
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def _accept(self) -> None:
        while not self.stop.is_set():
            for s in self.listeners:
                try:
                    conn = s.accept()[0]
                except (TimeoutError, OSError):
                    continue
                self.accepted.append(time.monotonic())
                conn.setblocking(False)
                self.held.append(conn)
            for conn in self.held:
                if conn.fileno() < 0:
                    continue
                try:
                    if conn.recv(1 << 16) == b"":  # the daemon hung up: it stopped waiting for us
                        self.hung_up.append(time.monotonic())
                        conn.close()
                except (BlockingIOError, InterruptedError):
                    pass
                except OSError:
                    self.hung_up.append(time.monotonic())
                    conn.close()

    @property
    def asked_s(self) -> float:
        return max(self.hung_up) - min(self.accepted)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        for s in self.listeners + self.held:
            s.close()


@pytest.mark.slow  # starts daemons (or waits out a read timeout): tens of seconds
def test_silent_offers_cost_a_bounded_time_at_start(fault_procs, tiny_model, tmp_path):
    plain = private_dir(tmp_path, "plain")
    baseline, p = timed(fault_procs.preload, tiny_model, NO_TUNE, "--weight-cache-socket-dir", str(plain))
    p.stop()
    d = private_dir(tmp_path, "silent")
    # A daemon that recorded its arena, so the next one asks the offers (one without a record asks none).
    fault_procs.preload(tiny_model, NO_TUNE, "--weight-cache-socket-dir", str(d)).stop()
    offers = SilentOffers(d, 6)
    try:
        seconds, q = timed(fault_procs.preload, tiny_model, NO_TUNE, "--weight-cache-socket-dir", str(d))
        wait_until(lambda: len(offers.hung_up) == 6, 5, "the daemon to hang up on all 6 offers")
    finally:
        offers.close()
    assert q.log().count("did not adopt the arena offered at") == 6
    assert len(offers.accepted) == 6, offers.accepted  # each asked once, all at once
    assert max(offers.accepted) - min(offers.accepted) < 1.0, offers.accepted
    # Silent offers are waited on for the whole budget, and not longer: was 5 s each, 32 s for 6.
    # The time they held the daemon is measured here, not as a difference of two starts: a start
    # alone varies by seconds on a busy machine (both starts are kept in the record, unjudged).
    assert ASK_BUDGET_S - CLOSE_SLACK_S <= offers.asked_s <= ASK_BUDGET_S + CLOSE_SLACK_S, offers.asked_s
    q.stop()
    figure("6 silent offers", asked_s=offers.asked_s, start_s=seconds, start_without_offers_s=baseline)


def _other_owner_0777(state: Path) -> Path:
    state.mkdir(parents=True)
    os.chown(state, 65534, 65534)  # nobody's, and anyone may write it
    os.chmod(state, 0o777)
    return state


def _open_parent(state: Path) -> Path:
    state.mkdir(parents=True, mode=0o700)
    os.chmod(state.parent, 0o777)  # ours, but anyone may swap the state directory inside it
    return state.parent


def _symlinked(state: Path) -> Path:
    real = state.with_name("real-state")
    real.mkdir(mode=0o700)
    state.symlink_to(real)
    return state


def _symlink_in_the_middle(state: Path) -> Path:
    # state = .../middle/wcache, with middle a link to a private directory
    real = state.parent.with_name("real-middle")
    (real / state.name).mkdir(parents=True, mode=0o700)
    state.parent.symlink_to(real)
    return state.parent


UNSAFE_STATE = {  # how the directory is made unsafe -> the part of the path the daemon names, and why
    "other owner, 0777": (_other_owner_0777, "belongs to uid 65534"),
    "parent writable by others": (_open_parent, "is writable by group or others (mode 777)"),
    "symlinked state dir": (_symlinked, "is a symbolic link"),
    "symlinked middle component": (_symlink_in_the_middle, "is a symbolic link"),
    "records dir writable by others": (lambda s: (s / "arenas").mkdir(parents=True) or os.chmod(s / "arenas", 0o777)
                                       or s / "arenas", "is writable by group or others (mode 777)"),
}


@pytest.mark.slow  # starts daemons (or waits out a read timeout): tens of seconds
@pytest.mark.parametrize("case", list(UNSAFE_STATE))
def test_a_state_dir_others_can_write_disables_hand_back(fault_procs, fault_env, tiny_model, tmp_path, case):
    make, why = UNSAFE_STATE[case]
    base = tmp_path / "s"
    base.mkdir(mode=0o700)
    state = base / "middle" / "wcache"
    state.parent.mkdir(mode=0o700) if case != "symlinked middle component" else None
    named = make(state)
    d = private_dir(tmp_path, "unsafe")
    p = fault_procs.preload(tiny_model, NO_TUNE, "--weight-cache-socket-dir", str(d),
                            env=dict(fault_env, WCACHE_STATE_DIR=str(state)))
    log = p.log()
    assert ARENA_RECORD_UNSAFE.format(dir=state / "arenas", why=f"{named} {why}") in log, log
    assert LOADED in log and ARENA_RECORDED.split(" {kind}")[0].format(rank=0) not in log
    assert not list(base.rglob("*.json"))  # no record written anywhere below
    assert call(d / SOCK_NAME, "get_memory")["ok"]  # and it serves from disk
    p.stop()


@pytest.mark.slow  # starts daemons (or waits out a read timeout): tens of seconds
def test_rehash_hashes_every_shard_on_each_start(fault_procs, tiny_model, tmp_path):
    d = private_dir(tmp_path, "rehash")
    p = fault_procs.preload(tiny_model, NO_TUNE, "--weight-cache-socket-dir", str(d))
    p.stop()
    q = fault_procs.preload(tiny_model, NO_TUNE, "--weight-cache-socket-dir", str(d), "--weight-cache-rehash")
    [(hashed, files)] = re.findall(r"hashed (\d+) of (\d+) files", q.log())
    assert hashed == files and int(files) > 0
    q.stop()


# -- 5. the engine's HTTP API ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def engine(fault_procs, tiny_model):
    return fault_procs.serve(tiny_model, NO_TUNE)


def http_raw(port: int, data: bytes, timeout: float = 40) -> tuple[int, dict, float]:
    """(status, JSON body, seconds) of the answer to raw bytes; the body must be JSON."""
    t0 = time.perf_counter()
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        try:
            s.sendall(data)
        except (BrokenPipeError, ConnectionResetError):
            pass
        buf = bytearray()
        try:
            while chunk := s.recv(1 << 16):
                buf += chunk
                head, sep, body = bytes(buf).partition(b"\r\n\r\n")
                m = re.search(rb"Content-Length: (\d+)", head)
                if sep and m and len(body) >= int(m.group(1)):
                    break
        except ConnectionResetError:
            pass
    head, _, body = bytes(buf).partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    return status, json.loads(body), time.perf_counter() - t0


def post(body: bytes, length: str | None = None) -> bytes:
    return (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: " + (length or str(len(body))).encode() + b"\r\n\r\n" + body)


MALFORMED_HTTP = {  # name: (request bytes, status, a piece of the message)
    "negative length": (post(b"x" * 4096, "-1"), 400, "Content-Length must be a number of bytes"),
    "signed length": (post(b"{}", "+2"), 400, "Content-Length must be a number of bytes"),
    "5000-digit length": (post(b"{}", "9" * 5000), 400, ""),
    "lone surrogate": (post(b'{"prompt": "\\ud800", "max_tokens": 2}'), 400, "lone surrogate"),
    "100k-deep nesting": (post(b'{"prompt": "a", "max_tokens": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"), 400,
                          "not valid JSON"),
    "5000-digit max_tokens": (post(b'{"prompt": "a", "max_tokens": ' + b"7" * 5000 + b"}"), 400, "not valid JSON"),
    "garbage request line": (b"GARBAGE\r\n\r\n", 400, "Bad request"),
    "no length": (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n\r\n", 411, "Content-Length header is required"),
}


@pytest.mark.parametrize("case", list(MALFORMED_HTTP))
def test_a_malformed_http_request_gets_a_json_4xx_and_the_server_stays_up(engine, case):
    data, status, piece = MALFORMED_HTTP[case]
    got, body, seconds = http_raw(engine.port, data)
    assert got == status and piece in body["error"]["message"], (got, body)
    assert seconds < 5
    assert "Traceback" not in engine.log()
    assert http_raw(engine.port, post(b'{"prompt": "ok", "max_tokens": 2}'))[0] == 200


@pytest.mark.slow  # starts daemons (or waits out a read timeout): tens of seconds
def test_half_sent_http_bodies_hold_a_bounded_number_of_threads(engine):
    """100 bodies that never finish wait on the waiting budget (256), not the completions' (64):
    a legitimate completion is served meanwhile (it was a 503 until issue ops-1), and the threads
    stay bounded by the two budgets and the health lane's."""
    from wcache.engine.api_server.http_front import DEFAULT_LIMITS as L
    from wcache.engine.api_server.server import BODY_DEADLINE_S, MAX_CONNECTIONS

    pid = engine.pid
    base = threads(pid)
    held = []
    try:
        with Peak(pid) as peak:
            for _ in range(MAX_CONNECTIONS + 36):  # 100 bodies that never finish
                s = socket.create_connection(("127.0.0.1", engine.port), timeout=10)
                s.sendall(post(b"", "100") + b'{"prompt":')
                held.append(s)
            time.sleep(0.5)
            status, body, seconds = http_raw(engine.port, post(b'{"prompt": "ok", "max_tokens": 2}'))
            assert status == 200 and seconds < 10, (status, body, seconds)
        # The first ones are cut at the body deadline with a 408, and the server serves again.
        s = held[0]
        s.settimeout(BODY_DEADLINE_S + 15)
        answer = s.recv(1 << 16)
        assert b" 408 " in answer.split(b"\r\n", 1)[0], answer[:200]
    finally:
        for s in held:
            s.close()
    wait_until(lambda: http_raw(engine.port, post(b'{"prompt": "ok", "max_tokens": 2}'))[0] == 200, 30,
               "the engine to serve again")
    bound = L.max_waiting_connections + L.max_connections + L.health_connections
    assert peak.threads <= base + min(bound, len(held) + 1) + 4, (base, peak.threads)  # a thread per connection
    assert "Traceback" not in engine.log()
    figure("half-sent HTTP bodies", connections=len(held) or MAX_CONNECTIONS + 36, threads_before=base,
           threads_peak=peak.threads, legit_answer_s=seconds)
