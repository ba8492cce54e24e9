"""The ``--respawn`` supervisor's front desk: it accepts every connection, reads each request
within the front door's limits, and hands the connection's descriptor with the bytes it read to
the serving worker (engine/respawn/handoff.py), keeping its own duplicate until the worker says it has
begun the answer. So a worker's death loses no request that it had not begun to answer: the
supervisor hands it again to the promoted spare. Whether an answer had begun is the kernel's
word, not the worker's: the supervisor reads how many bytes had been written to the connection
since it handed it over (``written``), so a worker killed after it said ``begun`` but before its
first byte left still has the request handed again, and a non-streamed answer that had been
written whole is left to its client. An answer partly written cannot be taken back: a stream ends
with an SSE error event that names the crash, anything else with a clean close.

Why not a listening socket shared by the workers (as before): the kernel queues new connections
for whoever accepts next, but a connection a worker has accepted dies with it, with the request it
carried, and so does every idle keep-alive connection it held. Here the supervisor holds every
connection between requests, and a worker holds one only while it answers it.

The limits are the front door's (engine/api_server/http_front.py's ``Limits``, handed in by run_respawn
before the exec): ``max_connections`` (past it, the longest-idle connection is closed, else a 503),
``idle_timeout_s`` between requests, and ``request_deadline_s`` for a request's bytes to arrive;
a request still incomplete at its deadline is handed over as it is, and the worker's own front
door answers it (a 408, a 413, a 400: one set of refusals, the worker's). Single-threaded: it runs
in the supervisor's select loop. Imports nothing of torch or the engine.
"""

from __future__ import annotations

import collections
import fcntl
import json
import logging
import re
import socket
import struct
import termios
import time

from wcache.engine.respawn import handoff

log = logging.getLogger("wcache.respawn")

MAX_HEAD = 64 << 10  # the request line and headers; longer, it is handed over for the worker to refuse
_LENGTH = re.compile(rb"^content-length:[ \t]*([0-9]{1,12})[ \t]*\r?$", re.I | re.M)
_CHUNKED = re.compile(rb"^transfer-encoding:", re.I | re.M)

READING, QUEUED, HANDED = "reading", "queued", "handed"
# struct tcp_info (linux/tcp.h): tcpi_bytes_acked, a u64 at byte 120, since Linux 4.1.
_BYTES_ACKED = struct.Struct("=Q")
_BYTES_ACKED_AT = 120


def written(sock: socket.socket) -> int | None:
    """Bytes written to this TCP connection by any process since it opened: those the peer
    acknowledged (TCP_INFO) plus those still in the send queue (SIOCOUTQ). None where the kernel
    cannot say (not TCP)."""
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _BYTES_ACKED_AT + _BYTES_ACKED.size)
        queued = struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0"))[0]
    except OSError:
        return None
    if len(info) < _BYTES_ACKED_AT + _BYTES_ACKED.size:
        return None
    return _BYTES_ACKED.unpack_from(info, _BYTES_ACKED_AT)[0] + queued


class Conn:
    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.buf = bytearray()
        self.state = READING
        self.since = time.monotonic()  # entered its state (reading: the last request ended)
        self.first_byte: float | None = None
        self.worker = None
        self.cid = 0
        self.begun = False
        self.stream = self.chunked = False
        self.written_at_hand: int | None = None  # written(sock) when it was handed to a worker
        self.length: int | None = None  # a non-streamed answer's whole size, as its worker announced it


def request_complete(buf: bytes, max_body: int) -> bool:
    """Whether ``buf`` holds a whole request (or one the worker must refuse: over-long head, a
    body too large or framed in a way the front door refuses, which it answers without more)."""
    end = buf.find(b"\r\n\r\n")
    if end < 0:
        return len(buf) > MAX_HEAD
    head = buf[:end]
    if _CHUNKED.search(head):
        return True  # refused by the worker (411 or 400), whatever follows
    lengths = _LENGTH.findall(head)
    if len(lengths) != 1:
        return True  # no body, or a framing the worker refuses
    length = int(lengths[0])
    return length > max_body or len(buf) - (end + 4) >= length



def answer_503(payload: dict, headers: bytes = b"") -> bytes:
    """A whole 503 response with a JSON body, as the supervisor answers for a worker not ready yet;
    ``headers``: more header lines, each ending in CRLF (a Retry-After)."""
    body = json.dumps(payload).encode()
    return (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n%s"
            b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (headers, len(body), body))

class Reception:
    def __init__(self, listener: socket.socket, limits: dict, responses: dict):
        self.listener = listener
        listener.setblocking(False)
        self.limits = limits
        self.responses = responses  # pre-rendered answers: busy, loading, health_loading; error_type
        self.conns: dict[int, Conn] = {}  # by the supervisor's descriptor
        self.queue: collections.deque[Conn] = collections.deque()
        self.serving = None  # the worker that gets requests, once it is ready
        self.ever_ready = False
        self.waiting_health: bytes | None = None  # a worker waits for the weight cache daemon (set_waiting)
        self.next_id = 0

    # -- the select loop's side ------------------------------------------------------------
    def fds(self) -> list[socket.socket]:
        return [self.listener] + [c.sock for c in self.conns.values() if c.state == READING]

    def readable(self, ready: list) -> None:
        for obj in ready:
            if obj is self.listener:
                self._accept()
            elif isinstance(obj, socket.socket) and obj.fileno() in self.conns:
                self._read(self.conns[obj.fileno()])

    def tick(self) -> None:
        """Idle keep-alive connections close; a request past its deadline is handed as it is."""
        now = time.monotonic()
        for c in list(self.conns.values()):
            if c.state != READING:
                continue
            if not c.buf and now - c.since > self.limits["idle_timeout_s"]:
                self._close(c)
            elif c.first_byte is not None and now - c.first_byte > self.limits["request_deadline_s"]:
                self._dispatch(c)

    # -- workers ---------------------------------------------------------------------------
    def set_waiting(self, body: dict | None) -> None:
        """A worker's loader waits for the weight cache daemon (``body``: what its /health would say,
        engine/loading/waiting.py), or no longer does (None): /health answers it until a worker is ready."""
        self.waiting_health = None if body is None else answer_503(body)

    def worker_ready(self, worker) -> None:
        self.serving, self.ever_ready = worker, True
        while self.queue and self.serving is worker:
            self._hand(self.queue.popleft(), worker)

    def on_frame(self, worker, frame: dict) -> None:
        """A worker's word about a connection it was handed; one about a connection it was not
        handed (another worker's, or none) changes nothing. Raises handoff.BadFrame for a frame that
        breaks the protocol."""
        if type(frame.get("id")) is not int or frame.get("event") not in ("begun", "done"):
            raise handoff.BadFrame(f"id {frame.get('id')!r}, event {frame.get('event')!r}")
        c = next((c for c in self.conns.values() if c.worker is worker and c.cid == frame.get("id")), None)
        if c is None:
            return
        if frame.get("event") == "begun":
            length = frame.get("length")
            if length is not None and (type(length) is not int or length < 0):
                raise handoff.BadFrame(f"answer length {length!r}")
            c.begun, c.stream, c.chunked = True, bool(frame.get("stream")), bool(frame.get("chunked"))
            c.length = length
        elif frame.get("event") == "done":
            if not frame.get("keep"):
                self._close(c)
                return
            rest = handoff.decode(frame.get("rest", ""))
            if len(rest) > self.limits["max_body"] + MAX_HEAD:
                raise handoff.BadFrame(f"{len(rest)} bytes of a next request")
            c.state, c.worker, c.begun, c.since = READING, None, False, time.monotonic()
            c.buf = bytearray(rest)
            c.first_byte = time.monotonic() if c.buf else None
            if c.buf and request_complete(bytes(c.buf), self.limits["max_body"]):
                self._dispatch(c)

    def worker_died(self, worker, message: str) -> tuple[int, int, int, int]:
        """Every connection ``worker`` held: handed again (no byte of its answer written), left
        with its client (a non-streamed answer written whole; the connection then closes, as the
        dead worker may have read past the request), a stream cut with an error event, or closed.
        Returns how many of each."""
        if self.serving is worker:
            self.serving = None
        again = whole = cut = closed = 0
        for c in [c for c in self.conns.values() if c.worker is worker]:
            now, then = written(c.sock), c.written_at_hand
            sent = None if now is None or then is None else now - then
            if not c.begun or sent == 0:
                c.state, c.worker, c.begun = QUEUED, None, False
                self.queue.appendleft(c)  # first in line for the next worker
                again += 1
            elif not c.stream and c.length is not None and sent == c.length:
                self._close(c)
                whole += 1
            elif c.stream:
                self._end_stream(c, message)
                cut += 1
            else:
                self._close(c)
                closed += 1
        return again, whole, cut, closed

    # -- connections -----------------------------------------------------------------------
    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                return  # EMFILE and the like: the connection waits in the backlog
            if len(self.conns) >= self.limits["max_connections"] and not self._make_room():
                self._answer_and_close(sock, self.responses["busy"])
                continue
            sock.setblocking(False)
            self.conns[sock.fileno()] = Conn(sock)

    def _make_room(self) -> bool:
        now = time.monotonic()
        idle = [c for c in self.conns.values() if c.state == READING and now - c.since >= self.limits["head_grace_s"]]
        if not idle:
            return False
        self._close(min(idle, key=lambda c: (bool(c.buf), c.since)))  # idle ones first, then the oldest
        return True

    def _read(self, c: Conn) -> None:
        try:
            data = c.sock.recv(1 << 16)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._close(c)
            return
        if c.first_byte is None:
            c.first_byte = time.monotonic()
        c.buf += data
        if request_complete(bytes(c.buf), self.limits["max_body"]):
            self._dispatch(c)

    def _dispatch(self, c: Conn) -> None:
        if not self.ever_ready:  # the first worker still loads: answer as its server would
            health = bytes(c.buf).startswith((b"GET /health ", b"HEAD /health "))
            self.conns.pop(c.sock.fileno(), None)
            answer = (self.waiting_health or self.responses["health_loading"]) if health else self.responses["loading"]
            self._answer_and_close(c.sock, answer)
            return
        c.state = QUEUED
        if self.serving is None:
            self.queue.append(c)
        else:
            self._hand(c, self.serving)

    def _hand(self, c: Conn, worker) -> None:
        self.next_id += 1
        c.cid, c.worker, c.state, c.begun, c.length = self.next_id, worker, HANDED, False, None
        c.written_at_hand = written(c.sock)
        try:
            handoff.send(worker.channel, {"id": c.cid, "data": handoff.encode(bytes(c.buf))}, fd=c.sock.fileno())
        except OSError:
            # The worker is gone or stuck; its death (reaped, or killed by the heartbeat) hands
            # this connection again, as it does every connection the worker held.
            log.debug("handoff of connection %d to pid %d failed", c.cid, worker.pid)

    def _end_stream(self, c: Conn, message: str) -> None:
        body = {"error": {"message": message, "type": self.responses["error_type"], "param": None, "code": 500}}
        event = b"data: " + json.dumps(body).encode() + b"\n\n"
        data = (b"%x\r\n%s\r\n0\r\n\r\n" % (len(event), event)) if c.chunked else event
        try:
            c.sock.setblocking(True)
            c.sock.settimeout(1.0)
            c.sock.sendall(data)
        except OSError:
            pass
        self._close(c)

    def _answer_and_close(self, sock: socket.socket, data: bytes) -> None:
        try:
            sock.setblocking(True)
            sock.settimeout(1.0)
            sock.sendall(data)
            sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        sock.close()

    def _close(self, c: Conn) -> None:
        self.conns.pop(c.sock.fileno(), None)
        try:
            self.queue.remove(c)
        except ValueError:
            pass
        try:
            c.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        c.sock.close()

    def close_all(self) -> None:
        for c in list(self.conns.values()):
            self._close(c)
