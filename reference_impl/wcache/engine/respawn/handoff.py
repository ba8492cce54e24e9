"""Frames between the ``--respawn`` supervisor and its workers over a Unix stream socket: a JSON
object (4-byte big-endian length, then UTF-8), optionally with one descriptor (SCM_RIGHTS) on its
first byte. No pickle: request bytes travel base64-encoded in a ``data`` field.

Supervisor to worker: ``{"id": N, "data": ...}`` with a client connection's descriptor: serve the
one request in ``data`` (read by the supervisor) on that connection. Worker to supervisor, about
connection N: ``{"id": N, "event": "begun", "stream": bool, "chunked": bool}`` before the first
byte of the answer is written, then ``{"id": N, "event": "done", "keep": bool, "rest": ...}`` when
the answer is sent (``keep``: the connection stays open for a next request, whose first bytes, if
the worker read any, are ``rest``).

Imports nothing of torch or the engine: the supervisor (engine/respawn/respawn.py) uses it.
"""

from __future__ import annotations

import base64
import json
import socket
import struct

MAX_FRAME = 8 << 20  # a request is at most 1 MiB of body plus its head; anything larger is a bug


class ChannelClosed(EOFError):
    pass


class BadFrame(ValueError):
    """A frame that breaks the protocol: too long, not a JSON object, or with fields of the wrong
    kind. The supervisor kills the worker that sent it (engine/respawn/respawn.py): it trusts nothing else
    that worker says."""


def parse(body: bytes) -> dict:
    try:
        frame = json.loads(body)
    except (UnicodeDecodeError, ValueError) as e:
        raise BadFrame(f"not JSON ({e})") from None
    if not isinstance(frame, dict):
        raise BadFrame(f"a JSON {type(frame).__name__}, not an object")
    return frame


def encode(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def decode(text) -> bytes:
    if not isinstance(text, str):
        raise BadFrame(f"bytes as a JSON {type(text).__name__}, not base64 text")
    try:
        return base64.b64decode(text.encode("ascii"), validate=True)
    except (UnicodeEncodeError, ValueError) as e:  # binascii.Error is a ValueError
        raise BadFrame(f"bytes that are not base64 ({e})") from None


def send(sock: socket.socket, frame: dict, fd: int | None = None) -> None:
    body = json.dumps(frame, separators=(",", ":")).encode()
    msg = struct.pack(">I", len(body)) + body
    sent = socket.send_fds(sock, [msg], [fd]) if fd is not None else sock.send(msg)
    if sent < len(msg):
        sock.sendall(msg[sent:])


def _exact(sock: socket.socket, n: int, first: bytes = b"") -> bytes:
    buf = bytearray(first)
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ChannelClosed()
        buf += chunk
    return bytes(buf)


def recv(sock: socket.socket) -> tuple[dict, int | None]:
    """The next frame and the descriptor that came with it (None if none). Blocking."""
    head, fds, _flags, _addr = socket.recv_fds(sock, 4, 1)
    if not head:
        for fd in fds:
            socket.close(fd)
        raise ChannelClosed()
    (length,) = struct.unpack(">I", _exact(sock, 4, head))
    if length > MAX_FRAME:
        raise BadFrame(f"a frame of {length} bytes (at most {MAX_FRAME})")
    return parse(_exact(sock, length)), (fds[0] if fds else None)


class FrameReader:
    """Frames from a non-blocking socket, as they arrive (the supervisor's select loop); worker to
    supervisor frames carry no descriptor."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.buf = bytearray()
        self.eof = False

    def read(self) -> list[dict]:
        if self.eof:
            return []
        try:
            data = self.sock.recv(1 << 16)
        except (BlockingIOError, InterruptedError, TimeoutError):
            return []
        except OSError:
            data = b""
        if not data:
            self.eof = True
        self.buf += data
        frames = []
        while len(self.buf) >= 4:
            (length,) = struct.unpack(">I", self.buf[:4])
            try:
                if length > MAX_FRAME:
                    raise BadFrame(f"a frame of {length} bytes (at most {MAX_FRAME})")
                if len(self.buf) < 4 + length:
                    break
                frames.append(parse(bytes(self.buf[4:4 + length])))
            except BadFrame:
                self.eof, self.buf = True, bytearray()  # nothing more is read from this peer
                raise
            del self.buf[:4 + length]
        return frames
