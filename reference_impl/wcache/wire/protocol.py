"""Frames on the daemon's Unix socket: an 8-byte big-endian length, then a UTF-8 JSON object.

File descriptors (the CPU arena) travel beside a frame as SCM_RIGHTS ancillary data. There is no
pickle anywhere: a peer that can connect can send only data, never code. Every reader bounds the
frame size, the descriptors per frame (not per recvmsg: a peer may split a frame into 1-byte
segments that each carry descriptors), the time a whole frame may take (not each recv), the
number of lists, objects and elements in it, counted on the bytes before they are parsed (a 16 MiB
frame of ``[],[],...`` parses into about 400 MiB of lists), and its nesting. It closes every
descriptor it did not hand on.
"""

from __future__ import annotations

import array
import json
import os
import socket
import struct
import threading
import time

from wcache import PROTOCOL_VERSION

MAX_FRAME_BYTES = 16 << 20  # a 10,000-tensor manifest is about 1.5 MB
MAX_FDS = 8
MAX_DEPTH = 32  # a request nests 3 levels; a manifest 4
MAX_CONTAINERS = 65_536  # lists and objects in one frame; a 10,000-tensor manifest has about 22,000
MAX_ITEMS = 1 << 20  # elements (commas + 1): a 10,000-tensor manifest has about 150,000
_HEADER = struct.Struct(">Q")
# The daemon's requests, in the order its docs list them; the daemon dispatches on exactly these
# (daemon/rank.py binds one handler to each and checks at import time that none is missing).
REQUESTS = ("get_state", "get_memory", "release")


class ProtocolError(Exception):
    pass


def encode(obj: dict) -> bytes:
    body = json.dumps(obj, separators=(",", ":")).encode()
    if len(body) > MAX_FRAME_BYTES:
        raise ProtocolError(f"frame of {len(body)} bytes exceeds the maximum of {MAX_FRAME_BYTES}")
    return _HEADER.pack(len(body)) + body


def send_frame(sock: socket.socket, obj: dict | bytes, fds: list[int] = ()) -> None:
    """Send a frame (a dict, or bytes already made by ``encode``) with optional descriptors."""
    data = obj if isinstance(obj, bytes) else encode(obj)
    if fds:
        # Descriptors ride on the first byte(s); the rest of the frame follows normally.
        sent = sock.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
        data = data[sent:]
    if data:
        sock.sendall(data)


class _Deadline:
    """A bound on a whole frame that starts with its first byte (the wait before it is the
    socket's own timeout, e.g. none on an engine's idle lease)."""

    def __init__(self, sock: socket.socket, seconds: float | None):
        self.sock, self.seconds, self.at = sock, seconds, None
        self.idle = sock.gettimeout()

    def arm(self) -> None:
        if self.seconds is not None and self.at is None:
            self.at = time.monotonic() + self.seconds

    def apply(self, got: int, n: int) -> None:
        if self.at is not None:
            left = self.at - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"frame not complete within {self.seconds}s ({got} of {n} bytes)")
            self.sock.settimeout(left if self.idle is None else min(left, self.idle))

    def restore(self) -> None:
        if self.at is not None:
            self.sock.settimeout(self.idle)


def _recv_exact(sock: socket.socket, n: int, fds: list[int], deadline: _Deadline | None = None) -> bytes:
    buf = bytearray()
    cmsg_space = socket.CMSG_SPACE(MAX_FDS * array.array("i").itemsize)
    while len(buf) < n:
        if deadline is not None:
            deadline.apply(len(buf), n)
        try:
            chunk, ancdata, flags, _ = sock.recvmsg(n - len(buf), cmsg_space)
        except TimeoutError:
            if deadline is not None:
                deadline.apply(len(buf), n)  # past the frame's deadline: say so, not just "timed out"
            raise
        for level, kind, payload in ancdata:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                got = array.array("i")
                got.frombytes(payload[: len(payload) - len(payload) % got.itemsize])
                fds.extend(got)
        if flags & socket.MSG_CTRUNC or len(fds) > MAX_FDS:  # counted over the whole frame
            raise ProtocolError(f"more than {MAX_FDS} file descriptors attached to a frame")
        if not chunk:
            if buf or n == _HEADER.size and fds:
                raise ProtocolError(f"connection closed after {len(buf)} of {n} bytes")
            raise EOFError("peer closed the connection")
        if deadline is not None:
            deadline.arm()
        buf += chunk
    return buf  # not bytes(buf): a copy would double what a 16 MiB frame holds


def check_size(body: bytes, max_containers: int = MAX_CONTAINERS, max_items: int = MAX_ITEMS) -> None:
    """Refuse, before parsing, a frame that could parse into more than ``max_containers`` lists and
    objects or ``max_items`` elements. Brackets and commas inside strings count too: the bound is
    conservative, and it costs a memchr-speed pass instead of a parse."""
    opened = body.count(b"[") + body.count(b"{")
    if opened > max_containers:
        raise ProtocolError(f"frame holds {opened} lists and objects; at most {max_containers} are allowed")
    items = body.count(b",") + 1
    if items > max_items:
        raise ProtocolError(f"frame holds {items} elements; at most {max_items} are allowed")


_SCALARS = {str, int, float, bool, type(None)}  # what json.loads makes besides dicts and lists


def check_depth(obj, max_depth: int = MAX_DEPTH) -> None:
    """Refuse a parsed frame nested deeper than ``max_depth`` (iterative: at most the containers
    check_size allowed are visited)."""
    stack = [(obj, 1)]
    while stack:
        node, depth = stack.pop()
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else ()
        if set(map(type, children)) <= _SCALARS:
            continue  # a list of 10,000 names, checked at C speed instead of one by one
        for child in children:
            if isinstance(child, (dict, list)):
                if depth + 1 > max_depth:
                    raise ProtocolError(f"frame nests deeper than {max_depth} levels")
                stack.append((child, depth + 1))


class FrameBudget:
    """Bytes of frames that all connections of a process may hold at once (read, parsed, handled).

    Each frame's length is taken, times ``factor`` (what parsing can make of it), before its body is
    read; the reading thread gives it back with ``release()`` once it has dropped the request.
    """

    def __init__(self, limit: int, factor: int = 4, small: int = 64 << 10):
        # Frames up to ``small`` bytes (every engine request) are not counted: a few peers holding
        # the budget with slow large frames must not lock engines out. MAX_CLIENTS of them is a bound.
        self.limit, self.factor, self.small = limit, factor, small
        self.held = 0
        self._lock = threading.Lock()
        self._mine = threading.local()

    def take(self, length: int) -> None:
        if length <= self.small:
            return
        cost = length * self.factor
        with self._lock:
            if self.held + cost > self.limit:
                raise BudgetExceeded(self.held, self.limit)
            self.held += cost
        self._mine.cost = getattr(self._mine, "cost", 0) + cost

    def release(self) -> None:
        cost, self._mine.cost = getattr(self._mine, "cost", 0), 0
        with self._lock:
            self.held -= cost


class BudgetExceeded(ProtocolError):
    def __init__(self, held: int, limit: int):
        super().__init__(f"frames in flight hold {held} of {limit} bytes")
        self.held, self.limit = held, limit


def recv_frame(sock: socket.socket, max_bytes: int = MAX_FRAME_BYTES, timeout: float | None = None,
               budget: FrameBudget | None = None, max_depth: int = MAX_DEPTH,
               max_containers: int = MAX_CONTAINERS, max_items: int = MAX_ITEMS) -> tuple[dict, list[int]]:
    """One frame and the descriptors that came with it. On any error the descriptors are closed.

    The wait for a frame's first byte is the socket's own timeout; ``timeout`` then bounds the
    whole frame (a peer sending 1 byte a second cannot stretch it). ``budget``: see FrameBudget.
    """
    fds: list[int] = []
    deadline = _Deadline(sock, timeout)
    try:
        (length,) = _HEADER.unpack(_recv_exact(sock, _HEADER.size, fds, deadline))
        if length > max_bytes:
            raise ProtocolError(f"frame of {length} bytes exceeds the maximum of {max_bytes}")
        if budget is not None:
            budget.take(length)
        try:
            body = _recv_exact(sock, length, fds, deadline)
        except EOFError:  # a whole header, then nothing: a truncated frame, not a clean close
            raise ProtocolError(f"connection closed after 0 of {length} bytes") from None
        check_size(body, max_containers, max_items)
        try:
            obj = json.loads(body)
        except (ValueError, RecursionError) as e:  # also an int past the digit limit, nesting past the stack
            raise ProtocolError(f"frame is not valid JSON: {e}") from None
        del body
        check_depth(obj, max_depth)
        if not isinstance(obj, dict):
            raise ProtocolError(f"frame must be a JSON object, got {type(obj).__name__}")
        version = obj.get("v")
        if type(version) is not int or version != PROTOCOL_VERSION:  # true and 1.0 equal 1 in Python
            raise ProtocolError(f"protocol version {version!r:.64} is not supported (this side speaks {PROTOCOL_VERSION})")
        return obj, fds
    except BaseException:
        close_fds(fds)
        if budget is not None:
            budget.release()
        raise
    finally:
        deadline.restore()


def close_fds(fds) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


def request(op: str, **fields) -> dict:
    return {"v": PROTOCOL_VERSION, "op": op, **fields}


def reply(ok: bool, **fields) -> dict:
    return {"v": PROTOCOL_VERSION, "ok": ok, **fields}


def drain(conn: socket.socket, limit: int = 1 << 20, seconds: float = 1.0) -> None:
    """After our last frame, read (bounded) what the peer still sends and drop it.

    Closing a socket with unread input resets the connection (Unix and TCP alike), and the peer
    would lose the answer we just sent: its shutdown or recv fails instead of reading our refusal.
    """
    deadline = time.monotonic() + seconds
    got = 0
    try:
        conn.shutdown(socket.SHUT_WR)
        while got < limit and (left := deadline - time.monotonic()) > 0:
            conn.settimeout(left)
            chunk = conn.recv(65536)
            if not chunk:
                break
            got += len(chunk)
    except OSError:
        pass
