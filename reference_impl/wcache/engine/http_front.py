"""The HTTP front door: what any request costs the server before a route sees it.

- **One deadline per request** (``request_deadline_s``, 30 s): it starts at the request's first byte
  and covers the request line, the headers and the body, however slowly they trickle in (a header
  line every 5 s does not renew it); each read also waits at most ``read_timeout_s``. Past either,
  a 408 and the connection is closed.
- **Framing as RFC 9112 asks:** a request with both ``Transfer-Encoding`` and ``Content-Length``, or
  with more than one ``Content-Length``, is a 400 and the connection is closed (either could be
  read two ways, the root of request smuggling); a body the route does not read closes the
  connection after the answer instead of being parsed as the next request.
- **Bounded connections:** at most ``max_connections`` are served at once, a thread each. When
  they are all taken, a new connection first makes room: the longest-idle connection (a keep-alive
  one waiting for its next request, or one that never sent a byte) is closed, else the one that
  has been sending its request line and headers the longest; either only once it has been so for
  ``head_grace_s`` (a client sends its head in one go, so a slow one is the attack, and a connection
  just accepted is not taken for an idle one).
  Only when every connection is working on a request does the newcomer get a 503 at once.
- **Idle keep-alive connections** are closed after ``idle_timeout_s`` (5 s, uvicorn's default,
  which vLLM's server runs on).

Every refusal is JSON in vLLM's error shape. A server can listen on a socket it binds or on an
already-bound listening socket it is handed (``sock=``), e.g. by a supervisor that owns the port.
"""

from __future__ import annotations

import errno
import json
import logging
import socket
import sys
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from wcache.engine.openai_api import error_body
from wcache.errors import BOTH_FRAMINGS, BUSY_MESSAGE, MANY_LENGTHS, ROOM_MADE, TIMED_OUT, ServeAddressError

log = logging.getLogger("wcache.server")

@dataclass(frozen=True)
class Limits:
    request_deadline_s: float = 30.0  # the whole request, from its first byte
    read_timeout_s: float = 10.0  # each read
    idle_timeout_s: float = 5.0  # a keep-alive connection waiting for its next request
    head_grace_s: float = 1.0  # idle, or request line + headers still arriving, this long: closed to make room
    max_connections: int = 64  # served at once (each is a thread)
    write_timeout_s: float = 30.0  # each write of an answer (a client that stops reading a stream)


DEFAULT_LIMITS = Limits()
LIMIT_DOCS = {  # docs/serve-reference.md's limit table is generated from these and the defaults
    "request_deadline_s": "a whole request from its first byte: request line, headers and body; then a 408",
    "read_timeout_s": "each wait for more bytes of a request; then a 408",
    "idle_timeout_s": "a keep-alive connection waiting for its next request; then it is closed",
    "head_grace_s": "when every connection is taken, one idle (or still sending its head) this long is closed "
                    "for the newcomer",
    "max_connections": "connections served at once, a thread each; past it, and with none to close, a 503",
    "write_timeout_s": "each write of an answer, a stream's included (a client that stops reading)",
}


class DeadlinePassed(TimeoutError):
    pass


class DeadlineReader:
    """The connection's reading side, with its own buffer so that every ``recv`` waits only as
    long as the request's deadline leaves (a file object's readline would wait per ``recv``)."""

    def __init__(self, sock: socket.socket, limits: Limits):
        self.sock, self.limits = sock, limits
        self.buf = bytearray()
        self.deadline: float | None = None

    def _fill(self) -> bool:
        timeout = self.limits.read_timeout_s
        if self.deadline is not None:
            left = self.deadline - time.monotonic()
            if left <= 0:
                raise DeadlinePassed()
            timeout = min(left, timeout)
        self.sock.settimeout(timeout)
        data = self.sock.recv(1 << 16)
        if not data:
            return False
        self.buf += data
        return True

    def wait_for_request(self, timeout: float) -> bool:
        """True once a request's first byte is here; False after ``timeout`` idle or a closed peer."""
        if self.buf:
            return True
        self.sock.settimeout(timeout)
        try:
            data = self.sock.recv(1 << 16)
        except OSError:  # the idle timeout, or the server closed it to make room
            return False
        self.buf += data
        return bool(data)

    def _take(self, n: int) -> bytes:
        out = bytes(self.buf[:n])
        del self.buf[:n]
        return out

    def readline(self, limit: int = -1) -> bytes:
        while True:
            i = self.buf.find(b"\n")
            if i >= 0 and (limit < 0 or i < limit):
                return self._take(i + 1)
            if 0 <= limit <= len(self.buf):
                return self._take(limit)
            if not self._fill():
                return self._take(len(self.buf))

    def read(self, n: int = -1) -> bytes:
        while (n < 0 or len(self.buf) < n) and self._fill():
            pass
        return self._take(len(self.buf) if n < 0 else n)

    def read1(self, n: int = -1) -> bytes:
        if not self.buf:
            self._fill()
        return self._take(len(self.buf) if n < 0 else n)

    def close(self) -> None:
        pass


IDLE, HEAD, BUSY = "idle", "head", "busy"


class Connections:
    """The connections being served and what each is doing, to pick one to close for a newcomer."""

    def __init__(self, limits: Limits):
        self.limits = limits
        self.slots = threading.BoundedSemaphore(limits.max_connections)
        self._lock = threading.Lock()
        self._state: dict[socket.socket, tuple[str, float]] = {}

    def mark(self, sock: socket.socket, state: str) -> None:
        with self._lock:
            self._state[sock] = (state, time.monotonic())

    def forget(self, sock: socket.socket) -> None:
        with self._lock:
            self._state.pop(sock, None)

    def make_room(self) -> bool:
        """Close the longest-idle connection, else the oldest slow head; False if none qualifies."""
        now = time.monotonic()
        with self._lock:
            old = [(st != IDLE, since, s) for s, (st, since) in self._state.items()
                   if st != BUSY and now - since >= self.limits.head_grace_s]
            pick = min(old, default=None, key=lambda x: x[:2])  # idle ones first, then the longest waiting
            if pick is None:
                return False
            victim = pick[2]
            self._state.pop(victim, None)
        log.info(ROOM_MADE.format(state="idle" if not pick[0] else "still sending its request head",
                                  seconds=now - pick[1], max=self.limits.max_connections))
        try:
            victim.shutdown(socket.SHUT_RDWR)  # its thread's recv returns at once; the thread frees its slot
        except OSError:
            pass
        return True

    def acquire(self) -> bool:
        if self.slots.acquire(blocking=False):
            return True
        while self.make_room():
            if self.slots.acquire(timeout=1.0):
                return True
        return False


def address_error(e: OSError, address) -> ServeAddressError:
    """The one-line error for a host and port that cannot be bound (here, or by `serve --respawn`'s supervisor)."""
    host, port = address[0], address[1]
    if e.errno == errno.EADDRINUSE:
        return ServeAddressError(ServeAddressError.IN_USE.format(host=host, port=port))
    return ServeAddressError(ServeAddressError.OTHER.format(host=host, port=port, error=e.strerror or e))


class FrontDoorServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 128  # a burst waits in the backlog, not in SYN retries

    def __init__(self, address, handler, limits: Limits = DEFAULT_LIMITS, sock: socket.socket | None = None):
        self.limits = limits
        self.connections = Connections(limits)
        try:
            super().__init__(address, handler, bind_and_activate=sock is None)
        except OSError as e:  # e.g. port 8000 taken: one line and status 2, not a traceback
            raise address_error(e, address) from None
        if sock is not None:  # a listening socket bound by another process (a supervisor owning the port)
            self.socket.close()
            self.socket = sock
            self.server_address = sock.getsockname()
            self.server_name, self.server_port = self.server_address[:2]

    def process_request(self, request, client_address):
        """A thread per connection, at most ``max_connections``: past that, room is made or a 503."""
        if not self.connections.acquire():
            try:
                request.settimeout(1.0)
                body = json.dumps(error_body(503, BUSY_MESSAGE.format(max=self.limits.max_connections))).encode()
                request.sendall(b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                                b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
            except OSError:
                pass
            self.shutdown_request(request)
            return
        self.connections.mark(request, IDLE)
        super().process_request(request, client_address)

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.connections.forget(request)
            self.connections.slots.release()

    def handle_error(self, request, client_address):
        if isinstance(sys.exc_info()[1], OSError):
            return  # the client gave up or was closed to make room: not worth a traceback
        super().handle_error(request, client_address)


class FrontDoorHandler(BaseHTTPRequestHandler):
    """Reads each request under its deadline and checks its framing; routes are ``do_GET`` etc."""

    server: FrontDoorServer
    protocol_version = "HTTP/1.1"

    def setup(self) -> None:
        super().setup()
        self.limits = self.server.limits
        self.rfile = DeadlineReader(self.connection, self.limits)

    def handle_one_request(self) -> None:
        conns, reader = self.server.connections, self.rfile
        conns.mark(self.connection, IDLE)
        if not reader.wait_for_request(self.limits.idle_timeout_s):
            self.close_connection = True
            return
        conns.mark(self.connection, HEAD)
        reader.deadline = time.monotonic() + self.limits.request_deadline_s
        try:
            self.raw_requestline = reader.readline(65537)
            if len(self.raw_requestline) > 65536:
                self.requestline = self.request_version = self.command = ""
                self.send_error(414)
                return
            if not self.raw_requestline:
                self.close_connection = True
                return
            if not self.parse_request():
                return
            conns.mark(self.connection, BUSY)
            problem = framing_problem(self.headers)
            if problem:
                self.close_connection = True
                self.send_json(400, error_body(400, problem))
                return
            if self.command != "POST" and (self.headers.get("Content-Length") or self.headers.get("Transfer-Encoding")):
                self.close_connection = True  # only POST reads a body: the rest must not be read as a request
            method = getattr(self, "do_" + self.command, None)
            if method is None:
                self.send_error(501, f"Unsupported method ({self.command!r})")
                return
            method()
            self.wfile.flush()
        except TimeoutError:  # the deadline, or one read that waited too long
            self.close_connection = True
            try:
                self.send_json(408, error_body(408, TIMED_OUT.format(deadline=self.limits.request_deadline_s,
                                                                      read=self.limits.read_timeout_s)))
            except OSError:
                pass
        finally:
            reader.deadline = None

    def read_body(self, length: int) -> bytes:
        """The body (under the request's deadline, like the head); a short one means the peer closed."""
        return self.rfile.read(length)

    def begin_answer(self) -> None:
        """The request is read: from here on only writes wait, each at most ``write_timeout_s``."""
        self.rfile.deadline = None
        self.connection.settimeout(self.limits.write_timeout_s)

    def send_error(self, code, message=None, explain=None):
        """The standard library's own refusals (bad request line, headers too long) as JSON."""
        self.close_connection = True
        if getattr(self, "request_version", "HTTP/0.9") in ("HTTP/0.9", ""):
            self.request_version = "HTTP/1.0"  # an unparsable request line still gets a status line
        try:
            self.send_json(code, error_body(code, message or self.responses.get(code, ("Error",))[0]))
        except OSError:
            pass

    def send_json(self, status: int, payload: dict) -> None:
        body = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, fmt, *args):  # access logs through logging, quietly
        log.debug("%s " + fmt, self.address_string(), *args)


def framing_problem(headers) -> str | None:
    lengths = headers.get_all("Content-Length") or []
    if headers.get("Transfer-Encoding") is not None and lengths:
        return BOTH_FRAMINGS
    if len(lengths) > 1 or any("," in v for v in lengths):
        return MANY_LENGTHS
    return None
