"""Frames on the daemon's Unix socket: an 8-byte big-endian length, then a UTF-8 JSON object.

File descriptors (the CPU arena) travel beside a frame as SCM_RIGHTS ancillary data. There is no
pickle anywhere: a peer that can connect can send only data, never code. Every reader bounds the
frame size and the number of descriptors, and closes any descriptor it did not hand on.
"""

from __future__ import annotations

import array
import json
import os
import socket
import struct
import time

from wcache import PROTOCOL_VERSION

MAX_FRAME_BYTES = 16 << 20  # a 10,000-tensor manifest is about 1.5 MB
MAX_FDS = 8
_HEADER = struct.Struct(">Q")
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


def _recv_exact(sock: socket.socket, n: int, fds: list[int]) -> bytes:
    buf = bytearray()
    cmsg_space = socket.CMSG_SPACE(MAX_FDS * array.array("i").itemsize)
    while len(buf) < n:
        chunk, ancdata, flags, _ = sock.recvmsg(n - len(buf), cmsg_space)
        for level, kind, payload in ancdata:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                got = array.array("i")
                got.frombytes(payload[: len(payload) - len(payload) % got.itemsize])
                fds.extend(got)
        if flags & socket.MSG_CTRUNC:
            raise ProtocolError(f"more than {MAX_FDS} file descriptors attached to a frame")
        if not chunk:
            if buf or n == _HEADER.size and fds:
                raise ProtocolError(f"connection closed after {len(buf)} of {n} bytes")
            raise EOFError("peer closed the connection")
        buf += chunk
    return bytes(buf)


def recv_frame(sock: socket.socket, max_bytes: int = MAX_FRAME_BYTES) -> tuple[dict, list[int]]:
    """One frame and the descriptors that came with it. On any error the descriptors are closed."""
    fds: list[int] = []
    try:
        (length,) = _HEADER.unpack(_recv_exact(sock, _HEADER.size, fds))
        if length > max_bytes:
            raise ProtocolError(f"frame of {length} bytes exceeds the maximum of {max_bytes}")
        try:
            body = _recv_exact(sock, length, fds)
        except EOFError:  # a whole header, then nothing: a truncated frame, not a clean close
            raise ProtocolError(f"connection closed after 0 of {length} bytes") from None
        try:
            obj = json.loads(body)
        except (ValueError, RecursionError) as e:  # also an int past the digit limit, nesting past the stack
            raise ProtocolError(f"frame is not valid JSON: {e}") from None
        if not isinstance(obj, dict):
            raise ProtocolError(f"frame must be a JSON object, got {type(obj).__name__}")
        version = obj.get("v")
        if type(version) is not int or version != PROTOCOL_VERSION:  # true and 1.0 equal 1 in Python
            raise ProtocolError(f"protocol version {version!r:.64} is not supported (this side speaks {PROTOCOL_VERSION})")
        return obj, fds
    except BaseException:
        close_fds(fds)
        raise


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
