"""Helpers of the fault suite: the tally its summary line prints, /proc probes of a live daemon rank,
raw protocol exchanges, and the seeded generator of hostile frames.

Every frame the generator makes comes with what the peer must do with it: answer ``ok``, refuse
and keep the connection (``mismatch``, ``in_use``), or answer ``protocol`` with a known message and
close. Nothing here imitates the daemon: the checks are about its observable replies only.
"""

from __future__ import annotations

import array
import json
import os
import random
import signal
import socket
import struct
import time
from dataclasses import dataclass, field
from pathlib import Path

from procs import alive, call, child_pids, wait_until  # noqa: F401  (the fault tests import alive, call and wait_until from here)
from wcache.core.device import device_identity
from wcache.wire.protocol import (
    MAX_CONTAINERS,
    MAX_DEPTH,
    MAX_FDS,
    MAX_FRAME_BYTES,
)
from wcache.wire.sockets import socket_name

HERE = Path(__file__).parent
SEED = int(os.environ.get("WCACHE_FUZZ_SEED", "20261202"))  # printed by the summary; set it to replay a run


# -- the tally behind `faults tried: N, frames fuzzed: M, crashes: 0, leaked fds: 0` ------------------
@dataclass
class Tally:
    faults: list[str] = field(default_factory=list)
    frames: int = 0
    malformed: int = 0
    crashes: int = 0
    leaked_fds: int = 0

    def fault(self, *names: str) -> None:
        self.faults.extend(names)

    def line(self) -> str:
        return (f"faults tried: {len(self.faults)}, frames fuzzed: {self.frames} ({self.malformed} malformed, "
                f"seed {SEED}), crashes: {self.crashes}, leaked fds: {self.leaked_fds}")


TALLY = Tally()


# -- a live daemon rank, seen from outside ----------------------------------------------------------
def default_socket(env: dict) -> Path:
    return Path(env["TMPDIR"]) / f"wcache_{os.getuid()}" / socket_name(device_identity("cpu", 0))


def rank_pids(launcher_pid: int) -> list[int]:
    """The daemon rank processes a `wcache preload` launcher started (its children)."""
    return child_pids(launcher_pid)


def fd_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def thread_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


def connections_to(path: Path) -> int:
    """Connections to the Unix socket at ``path``, accepted or still in its backlog (the listener
    itself excluded): the server-side sockets carry the path in /proc/net/unix."""
    n = 0
    for line in Path("/proc/net/unix").read_text().splitlines()[1:]:
        parts = line.split()
        if len(parts) >= 8 and parts[7] == str(path) and parts[3] != "00010000":  # not the listener
            n += 1
    return n


def settle(pid: int, baseline: int, count=fd_count, timeout: float = 10.0) -> int:
    """Wait (bounded) for ``count(pid)`` to come back to ``baseline``; return the final excess."""
    deadline = time.monotonic() + timeout
    while (n := count(pid)) > baseline and time.monotonic() < deadline:
        time.sleep(0.05)
    return max(0, n - baseline)


def _all_threads_stopped(pid: int) -> bool:
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
        except FileNotFoundError:  # the thread exited
            continue
        if stat.rpartition(")")[2].split()[0] not in ("T", "t"):
            return False
    return True


def stop_when(pid: int, holds, timeout: float, slice_s: float = 0.001) -> bool:
    """Leave ``pid`` stopped (SIGSTOP) at a moment when ``holds()`` is true; False if it exited or
    ``timeout`` passed first (then it is left running).

    Polling a running process misses a window shorter than one poll, and on a busy machine the poller
    may not run for tens of ms. Here the process runs only ``slice_s`` at a time and ``holds()`` is
    read while every thread of it is stopped, so any window that lasts longer than one slice (plus a
    signal's delivery) of the process's own progress is caught, however loaded the machine is.
    """
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, signal.SIGSTOP)
            while not _all_threads_stopped(pid):
                time.sleep(0.0001)
            if holds():
                return True
            os.kill(pid, signal.SIGCONT)
        except (ProcessLookupError, FileNotFoundError):
            return False
        time.sleep(slice_s)
    return False


def frame(body: bytes | dict | list) -> bytes:
    if not isinstance(body, bytes):
        body = json.dumps(body).encode()
    return struct.pack(">Q", len(body)) + body


def split_replies(buf: bytes) -> list[dict]:
    """The frames in what a peer sent before closing (a partial trailing frame is an error)."""
    out, i = [], 0
    while i < len(buf):
        assert i + 8 <= len(buf), f"a partial header at byte {i}"
        (n,) = struct.unpack(">Q", buf[i : i + 8])
        assert i + 8 + n <= len(buf), f"a partial frame of {n} bytes at byte {i}"
        out.append(json.loads(buf[i + 8 : i + 8 + n]))
        i += 8 + n
    return out


def exchange(sock: socket.socket, first: bytes, last: bytes = b"", fds=(), timeout: float = 20.0) -> list[dict]:
    """Send ``first``, then ``last`` with ``fds`` on its first byte; close our side; read every
    reply to EOF."""
    sock.settimeout(timeout)
    try:
        sock.sendall(first)
        if fds:
            sent = sock.sendmsg([last], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
            last = last[sent:]
        sock.sendall(last)
        sock.shutdown(socket.SHUT_WR)
    except (BrokenPipeError, ConnectionResetError):
        pass  # the peer refused before reading everything; its answer is still queued for us
    buf = bytearray()
    while True:
        try:
            chunk = sock.recv(1 << 16)
        except ConnectionResetError:
            break
        if not chunk:
            break
        buf += chunk
    return split_replies(bytes(buf))


# -- the frame generator ---------------------------------------------------------------------------
# The texts a malformed frame may be answered with (wcache.wire.protocol and errors.DAEMON_ERRORS).
FRAME_ERRORS = ("connection closed after ", "frame of ", "frame is not valid JSON", "frame must be a JSON object",
                "protocol version ", f"more than {MAX_FDS} file descriptors", "frame holds ", "frame nests deeper")
REQUEST_ERRORS = ("unknown request ", "get_state needs a key object")


@dataclass
class Fuzz:
    label: str
    data: bytes
    expect: str  # "ok" | "mismatch" | "in_use" | "protocol" | "close" (EOF at a frame boundary: no answer)
    fds: int = 0  # descriptors to attach
    message: str | None = None  # for "protocol": the text the answer must contain, when it is known

    def __repr__(self) -> str:  # assertion messages stay readable: a frame may be megabytes
        return f"<{self.label}: {len(self.data)} bytes {self.data[:48]!r}..., expect {self.expect}>"


def _text(rng: random.Random, n: int = 8) -> str:
    alphabet = "aZ_ -.:/\\\"'{}[]\0\n\t\u00e9\u2603\U0001f600\ud800\udfff"
    return "".join(rng.choice(alphabet) for _ in range(rng.randint(0, n)))


def _value(rng: random.Random, depth: int = 0):
    kind = rng.randrange(11 if depth < 2 else 8)
    if kind == 8:
        return [_value(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    if kind == 9:
        return {_text(rng, 4): _value(rng, depth + 1) for _ in range(rng.randint(0, 3))}
    if kind == 10:
        return "x" * rng.randint(0, 4096)
    return [None, True, False, rng.randint(-2**63, 2**63), rng.random() * 1e308, float("nan"), _text(rng),
            rng.randint(0, 9)][kind]


def _dumps(obj) -> bytes:
    # NaN and Infinity go out as Python writes them (its reader accepts them); lone surrogates as
    # \\uXXXX escapes, which the reader turns back into lone surrogates.
    return json.dumps(obj).encode()


def keep_open(rng: random.Random) -> Fuzz:
    """A well-formed request the daemon answers without closing."""
    r = rng.randrange(10)
    extra = {_text(rng, 6) or "x": _value(rng) for _ in range(rng.randint(0, 3))}
    extra.pop("v", None), extra.pop("op", None), extra.pop("key", None), extra.pop("mode", None)
    if r < 4:
        return Fuzz("get_memory with extra fields", frame(_dumps({"v": 1, "op": "get_memory", **extra})), "ok")
    if r < 8:  # a key of any shape and value types: never the daemon's, so a mismatch (capped)
        key = {_text(rng, 12): _value(rng) for _ in range(rng.randint(0, 6))}
        if rng.random() < 0.01:  # thousands of long field names: the reply must stay bounded
            key.update({f"{i}-" + "k" * 20_000: i for i in range(rng.randint(65, 300))})
        if rng.random() < 0.3:
            key["dtype"] = _value(rng)
        return Fuzz("get_state with a wrong key", frame(_dumps({"v": 1, "op": "get_state", "key": key,
                                                                "mode": rng.choice(["zero_copy", "copy"])})),
                    "mismatch")
    # release while the suite's own engine holds a zero_copy lease: refused, nothing released
    return Fuzz("release while a zero_copy engine maps", frame(_dumps({"v": 1, "op": "release", **extra})), "in_use")


FRAME_LEVEL = (0, 1, 2, 3, 4, 5, 6, 7, 8, 11, 12, 14)  # the kinds below that fail before any field is read


def terminal(rng: random.Random, max_bytes: int = MAX_FRAME_BYTES, fds_ok: bool = True,
             frame_level: bool = False) -> Fuzz:
    """A malformed, truncated, oversize, wrong-version or wrong-type frame: answered ``protocol``
    (with the known text where it is deterministic), then the connection closes. ``frame_level``:
    only frames the reader itself rejects (a seed listener looks at the token next)."""
    r = rng.choice(FRAME_LEVEL) if frame_level else rng.randrange(16)
    if r == 0:
        k = rng.randint(1, 7)
        return Fuzz("truncated header", bytes(rng.getrandbits(8) for _ in range(k)), "protocol",
                    message=f"connection closed after {k} of 8 bytes")
    if r == 1:
        n = rng.randint(2, 4096)
        got = rng.randrange(0, n)
        return Fuzz("truncated body", struct.pack(">Q", n) + b"{" * got, "protocol",
                    message=f"connection closed after {got} of {n} bytes")
    if r == 2:
        n = rng.choice([max_bytes + 1, rng.randint(max_bytes + 1, 2**64 - 1), 2**64 - 1, 2**63])
        return Fuzz("oversize length", struct.pack(">Q", n) + os.urandom(rng.randint(0, 256)), "protocol",
                    message=f"frame of {n} bytes exceeds the maximum of {max_bytes}")
    if r == 3:
        body = bytes(rng.getrandbits(8) for _ in range(rng.randint(0, 64)))
        return Fuzz("random bytes", frame(body), "protocol")  # not JSON, or JSON but not an object
    if r == 4:
        body = rng.choice([b"\xff\xfe{}", b'{"v": 1, "op": "\xc3\x28"}', b"\xed\xa0\x80", b'{"v":1}\x80'])
        return Fuzz("invalid UTF-8", frame(body), "protocol", message="frame is not valid JSON")
    if r == 5:
        obj = rng.choice([[1, 2], "get_memory", 1, None, True, 1.5, [{"v": 1, "op": "get_memory"}]])
        name = {list: "list", str: "str", int: "int", type(None): "NoneType", bool: "bool", float: "float"}[type(obj)]
        return Fuzz("JSON that is not an object", frame(_dumps(obj)), "protocol",
                    message=f"frame must be a JSON object, got {name}")
    if r == 6:
        v = rng.choice([0, 2, -1, 99, 2**40, "1", 1.0, True, False, None, [], {}, "v1", 1.5, "x" * 500])
        obj = {"op": "get_memory"} if rng.random() < 0.1 else {"v": v, "op": "get_memory"}
        return Fuzz("wrong protocol version", frame(_dumps(obj)), "protocol", message="protocol version ")
    if r == 7:
        # Past the container bound the bytes are refused unparsed; under it the parser's own
        # recursion limit or the nesting bound refuses them.
        d = rng.choice([rng.randint(MAX_DEPTH + 1, 200), rng.randint(2000, min(200_000, (max_bytes - 32) // 2))])
        # Deep: the reader's container bound (the daemon's is lower than MAX_CONTAINERS) or the parser.
        expect = ("frame holds " if d + 1 > MAX_CONTAINERS else
                  "frame " if d >= 2000 else f"frame nests deeper than {MAX_DEPTH} levels")
        return Fuzz("nesting past the stack", frame(b'{"v":1,"op":' + b"[" * d + b"]" * d + b"}"), "protocol",
                    message=expect)
    if r == 8:
        return Fuzz("an integer past the digit limit", frame(b'{"v":1,"op":"get_memory","n":' + b"7" * 5000 + b"}"),
                    "protocol", message="frame is not valid JSON")
    if r == 9:
        op = rng.choice([123, None, [], {}, True, "", "GET_STATE", "get_state\0", "release ", _text(rng, 20),
                         "x" * 10_000])
        obj = {"v": 1, "op": op} if op is not None or rng.random() < 0.5 else {"v": 1}
        return Fuzz("unknown or wrong-type op", frame(_dumps(obj)), "protocol", message="unknown request ")
    if r == 10:
        obj = {"v": 1, "op": "get_state"}
        if rng.random() < 0.5:  # a key that is not an object (or none), any mode
            key = rng.choice([None, [], "key", 1, True, [["checkpoint", "x"]], "missing"])
            if key != "missing":
                obj["key"] = key
            if rng.random() < 0.7:
                obj["mode"] = rng.choice(["zero_copy", "copy", "steal", 0])
        else:  # an object key with a mode that is not one of the two
            obj.update(key={}, mode=rng.choice(["", "ZERO_COPY", "zero-copy", 1, None, [], {}, "steal"]))
        return Fuzz("get_state with wrong-type fields", frame(_dumps(obj)), "protocol",
                    message="get_state needs a key object")
    if r == 11:
        return Fuzz("empty body", frame(b""), "protocol", message="frame is not valid JSON")
    if r == 12:
        # A bad frame followed by garbage the daemon never reads as a frame.
        return Fuzz("trailing garbage after a bad frame", frame(b"[]") + os.urandom(rng.randint(1, 2048)), "protocol",
                    message="frame must be a JSON object, got list")
    if r == 13 and fds_ok:
        n = rng.randint(MAX_FDS + 1, 2 * MAX_FDS)
        return Fuzz("too many descriptors", frame({"v": 1, "op": "get_memory"}), "protocol", fds=n,
                    message=f"more than {MAX_FDS} file descriptors")
    if r == 14:
        return Fuzz("JSON with a duplicate version", frame(b'{"v":1,"op":"get_memory","v":2}'), "protocol",
                    message="protocol version 2 is not supported")
    # Random JSON objects of version 1 with random fields: whatever op they carry is not a request.
    obj = {_text(rng, 6): _value(rng) for _ in range(rng.randint(0, 5))}
    obj.update(v=1, op=rng.choice([None, 0, "get-memory", "shutdown", "put_state", _text(rng)]))
    return Fuzz("random version-1 object", frame(_dumps(obj)), "protocol", message="unknown request ")


def connection_plan(rng: random.Random, fds_ok: bool = True) -> list[Fuzz]:
    """What one fuzz connection sends: 0-3 requests that keep it open, then usually a bad frame
    (sometimes with descriptors attached), else a clean close."""
    plan = [keep_open(rng) for _ in range(rng.choice([0, 0, 0, 1, 1, 2, 3]))]
    if rng.random() < 0.97 or not plan:
        bad = terminal(rng, fds_ok=fds_ok)
        if fds_ok and not bad.fds and rng.random() < 0.05:
            bad.fds = rng.randint(1, MAX_FDS)  # descriptors the daemon must close, never keep
        plan.append(bad)
    return plan


def check_replies(plan: list[Fuzz], replies: list[dict]) -> None:
    """Every frame got its answer, in order: the requests theirs, the bad frame a ``protocol`` error
    with its message; nothing after it."""
    expected = [f for f in plan if f.expect != "close"]
    assert len(replies) == len(expected), (plan, [str(r)[:300] for r in replies])
    for f, answer in zip(expected, replies):
        assert answer.get("v") == 1, (f.label, answer)
        if f.expect == "ok":
            assert answer["ok"] is True and "weights_bytes" in answer, (f.label, answer)
            continue
        assert answer["ok"] is False and answer["error"] == f.expect, (f.label, answer)
        assert isinstance(answer["message"], str) and answer["message"], (f.label, answer)
        if f.expect == "protocol":
            known = FRAME_ERRORS + REQUEST_ERRORS
            assert answer["message"].startswith(known), (f.label, answer)
            if f.message:
                assert f.message in answer["message"], (f.label, f.message, answer)
        if f.expect == "mismatch":
            assert 0 < len(answer["fields"]) <= 64 and all(len(n) <= 128 for n in answer["fields"]), (f.label, answer)
