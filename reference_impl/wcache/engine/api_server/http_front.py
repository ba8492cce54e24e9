"""The HTTP front door: what any request costs the server before a route sees it.

- **One deadline per request** (``request_deadline_s``, 30 s): it starts at the request's first byte
  and covers the request line, the headers and the body, however slowly they trickle in (a header
  line every 5 s does not renew it); each read also waits at most ``read_timeout_s``. Past either,
  a 408 and the connection is closed.
- **Framing as RFC 9112 asks:** a request with both ``Transfer-Encoding`` and ``Content-Length``, or
  with more than one ``Content-Length``, is a 400 and the connection is closed (either could be
  read two ways, the root of request smuggling); a body the route does not read closes the
  connection after the answer instead of being parsed as the next request.
- **Three budgets, a thread per connection.** A connection is *waiting* while it is idle (a
  keep-alive one between requests, or one that has not sent a byte) or while its request (line,
  headers, body) arrives: at most ``max_waiting_connections`` at once. Once its request is all
  here it is *working*: a completion (any route but the health lane's) takes one of
  ``max_connections`` (``--max-concurrent-connections``), else a 503 at once; ``/health``,
  ``/metrics`` and ``/version`` take one of ``health_connections`` instead, so they are answered
  however many completions run or wait for the engine, and a flood of probes cannot take the
  completions' budget either.
- **Under pressure the slowest deliverers are shed.** When every waiting slot is taken, a new
  connection makes room: the longest-idle connection is closed, else the one delivering its
  request the slowest (bytes per second since its first byte, whatever part it is in: line,
  headers or body), either only once it has been so for ``head_grace_s`` (a client sends its
  request in one go, so a slow one is the attack, and a connection just accepted is not judged).
  Only when none qualifies does the newcomer get a 503 at once. The waiting budget is four times
  the working one because waiting costs a thread and nothing else: a slow-body attack of the
  issue's 64 connections fills neither.
- **Idle keep-alive connections** are closed after ``idle_timeout_s`` (5 s, uvicorn's default,
  which vLLM's server runs on).
- **Every request has an id and a log line:** ``X-Request-Id`` is the client's when valid
  (request_id.py), else a new one, echoed in the answer; one access-log line per request
  (access_log.py) unless the server's ``log_requests`` is off.

Every refusal is JSON in vLLM's error shape. A server can listen on a socket it binds or on an
already-bound listening socket it is handed (``sock=``), e.g. by a supervisor that owns the port.
"""

from __future__ import annotations

import errno
import json
import logging
import select
import socket
import sys
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from wcache.engine.api_server.access_log import RequestRecord
from wcache.engine.api_server.access_log import log as access_log
from wcache.engine.api_server.worker_threads import START_IDLE, WorkerThreads
from wcache.engine.openai.openai_api import error_body
from wcache.engine.api_server.request_id import HEADER as REQUEST_ID_HEADER
from wcache.engine.api_server.request_id import request_id
from wcache.errors import (BOTH_FRAMINGS, BUSY_MESSAGE, LANE_BUSY, MANY_LENGTHS, NOT_ALLOWED, ROOM_MADE, TIMED_OUT,
                           ServeAddressError)

log = logging.getLogger("wcache.server")

# The health lane: answered on their own budget, ahead of and apart from completions.
LANE_PATHS = ("/health", "/metrics", "/version")
LANE_METHODS = ("GET", "HEAD")
SWITCH_INTERVAL_S = 0.001


@dataclass(frozen=True)
class Limits:
    request_deadline_s: float = 30.0  # the whole request, from its first byte
    read_timeout_s: float = 10.0  # each read
    idle_timeout_s: float = 5.0  # a keep-alive connection waiting for its next request
    head_grace_s: float = 1.0  # idle, or its request still arriving, this long: may be closed to make room
    max_connections: int = 64  # working on a request at once (each is a thread): --max-concurrent-connections
    write_timeout_s: float = 30.0  # each write of an answer (a client that stops reading a stream)
    max_waiting_connections: int = 256  # idle or still sending their request
    health_connections: int = 8  # answering /health, /metrics or /version at once


DEFAULT_LIMITS = Limits()
LIMIT_DOCS = {  # docs/serve-reference.md's limit table is generated from these and the defaults
    "request_deadline_s": "a whole request from its first byte: request line, headers and body; then a 408",
    "read_timeout_s": "each wait for more bytes of a request; then a 408",
    "idle_timeout_s": "a keep-alive connection waiting for its next request; then it is closed",
    "head_grace_s": "when every waiting slot is taken, one idle (or the slowest still sending its request) this "
                    "long is closed for the newcomer",
    "max_connections": "connections working on a request at once (`--max-concurrent-connections`), a thread each; "
                       "past it a 503 (the health lane is apart)",
    "write_timeout_s": "each write of an answer, a stream's included (a client that stops reading)",
    "max_waiting_connections": "connections idle or still sending their request, a thread each; past it the "
                               "slowest is closed for a newcomer, or with none to close, a 503",
    "health_connections": "`/health`, `/metrics` and `/version` answered at once, apart from the completion "
                          "limit; past it a 503",
}


class DeadlinePassed(TimeoutError):
    pass


# Every "busy" 503 says when to come back, as the full waiting queue's does (server.py): a slot
# frees when any answer ends, so one second.
BUSY_RETRY_AFTER_S = 1


class Refused(Exception):
    """The request is read but no budget is left to work on it: answered with this status and message."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


class DeadlineReader:
    """The connection's reading side, with its own buffer so that every ``recv`` waits only as
    long as the request's deadline leaves (a file object's readline would wait per ``recv``)."""

    def __init__(self, sock: socket.socket, limits: Limits):
        self.sock, self.limits = sock, limits
        self.buf = bytearray()
        self.deadline: float | None = None
        self.received = 0  # bytes of the current request (the delivery rate that shedding judges)

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
        self.received += len(data)
        return True

    def wait_for_request(self, timeout: float) -> bool:
        """True once a request's first byte is here; False after ``timeout`` idle or a closed peer."""
        self.received = len(self.buf)
        if self.buf:
            return True
        self.sock.settimeout(timeout)
        try:
            # Peek, not read: until the handler marks it arriving, the byte waiting in the socket
            # is what tells the scheduler a request is arriving (Connections.arriving polls it).
            return bool(self.sock.recv(1, socket.MSG_PEEK))
        except OSError:  # the idle timeout, or the server closed it to make room
            return False

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


IDLE, ARRIVING = "idle", "arriving"  # a waiting connection's state
# A new connection counts as a request arriving for this long (Connections.arriving): one that
# connects and sends nothing (a client's pool, a slow client) holds back no step after it.
FRESH_S = 0.02
WAITING, WORKING, LANE = "waiting", "working", "lane"  # the budget a connection holds


class Connections:
    """The connections being served, the budget each holds, and what each waiting one is doing (to
    pick one to close for a newcomer). One lock; nothing in it waits."""

    def __init__(self, limits: Limits):
        self.limits = limits
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)  # a connection changed state (wait_arrived)
        self._budget: dict[socket.socket, str] = {}
        self._fresh: dict[socket.socket, float] = {}  # accepted (when), its first request not yet arriving
        self._waiting: dict[socket.socket, tuple[str, float, DeadlineReader | None]] = {}
        self._unhanded: set[socket.socket] = set()  # read, working, not yet handed to the engine (handed)
        self._used = {WAITING: 0, WORKING: 0, LANE: 0}
        self._size = {WAITING: limits.max_waiting_connections, WORKING: limits.max_connections,
                      LANE: limits.health_connections}

    def used(self, budget: str) -> int:
        with self._lock:
            return self._used[budget]

    def _take(self, sock, budget: str) -> bool:
        if self._used[budget] >= self._size[budget]:
            return False
        old = self._budget.get(sock)
        if old is not None:
            self._used[old] -= 1
        self._waiting.pop(sock, None)
        self._budget[sock] = budget
        self._used[budget] += 1
        return True

    def admit(self, sock: socket.socket) -> bool:
        """A new connection: a waiting slot, made by closing an idle or slow one if need be."""
        with self._lock:
            if not self._take(sock, WAITING) and not (self._evict() and self._take(sock, WAITING)):
                return False
            now = time.monotonic()
            self._waiting[sock], self._fresh[sock] = (IDLE, now, None), now
            return True

    def mark(self, sock: socket.socket, state: str, reader: DeadlineReader | None = None) -> bool:
        """Back to waiting, idle or with a request arriving; False if it was closed to make room
        (or, after a request, no waiting slot is left: a keep-alive connection is best effort)."""
        with self._lock:
            if self._budget.get(sock) != WAITING and not self._take(sock, WAITING):
                return False
            self._waiting[sock] = (state, time.monotonic(), reader)
            self._unhanded.discard(sock)
            if state == ARRIVING:
                self._fresh.pop(sock, None)
            self._changed.notify_all()
            return True

    def work(self, sock: socket.socket, budget: str) -> bool:
        """Its request is here: from waiting to ``WORKING`` or ``LANE``; False when that budget is full."""
        with self._lock:
            if sock not in self._budget:
                return False  # closed to make room as its request completed: it leaves
            self._changed.notify_all()
            ok = self._budget[sock] == budget or self._take(sock, budget)
            if ok and budget == WORKING:
                self._unhanded.add(sock)
            return ok

    def handed(self, sock: socket.socket) -> None:
        """Its request is in the engine's queue (or answered without it): no longer arriving. From
        reading its head until then (parsing the body, tokenizing), a request counts as arriving:
        a burst's last request was otherwise left out of its first step at times."""
        with self._lock:
            if sock in self._unhanded:
                self._unhanded.discard(sock)
                self._changed.notify_all()

    def forget(self, sock: socket.socket) -> None:
        with self._lock:
            budget = self._budget.pop(sock, None)
            if budget is not None:
                self._used[budget] -= 1
            self._waiting.pop(sock, None)
            self._fresh.pop(sock, None)
            self._unhanded.discard(sock)
            self._changed.notify_all()

    def in_flight(self) -> int:
        """Requests arriving or being answered (a drain waits for these)."""
        with self._lock:
            return self._used[WORKING] + self._used[LANE] + sum(
                1 for st, _, _ in self._waiting.values() if st == ARRIVING)

    def arriving(self, wait: float = 0.0) -> bool:
        """Is a request arriving: being read or parsed (not yet ``handed`` to the engine), sent on an
        idle connection whose thread has not woken yet, or expected on a connection accepted within
        ``FRESH_S``? If one is, waits up to ``wait`` seconds for a change and looks again."""
        with self._changed:
            busy = self._arriving()
            if busy and wait > 0:
                self._changed.wait(wait)
                busy = self._arriving()
            return busy

    def _arriving(self) -> bool:  # under the lock
        if self._unhanded:
            return True
        now, idle = time.monotonic(), []
        for sock, (state, _, _) in self._waiting.items():
            if state == ARRIVING:
                return True
            idle.append(sock)
        if any(now - since < FRESH_S for since in self._fresh.values()):
            return True
        poller = select.poll()
        for sock in idle:
            try:
                poller.register(sock, select.POLLIN)
            except (OSError, ValueError):  # closed meanwhile
                pass
        return bool(poller.poll(0))

    def close_idle(self) -> None:
        """Close every idle connection (a drain: no next request will be served on them)."""
        with self._lock:
            idle = [s for s, (st, _, _) in self._waiting.items() if st == IDLE]
        for s in idle:
            _shut(s)

    def close_waiting(self) -> None:
        """Close every waiting connection, idle or with its request still arriving (a drain's deadline)."""
        with self._lock:
            waiting = list(self._waiting)
        for s in waiting:
            _shut(s)

    def _evict(self) -> bool:
        """Close the longest-idle waiting connection, else the slowest deliverer, each only past
        the grace; its slot is free at once (its thread leaves without it). Called under the lock."""
        now = time.monotonic()
        grace = self.limits.head_grace_s
        pick, key = None, None
        for s, (st, since, reader) in self._waiting.items():
            age = now - since
            if age < grace:
                continue
            # idle ones first, longest idle first; then the lowest bytes per second
            k = (0, -age) if st == IDLE else (1, (reader.received if reader else 0) / age)
            if key is None or k < key:
                pick, key = s, k
        if pick is None:
            return False
        st, since, _ = self._waiting.pop(pick)
        self._used[self._budget.pop(pick)] -= 1
        log.info(ROOM_MADE.format(state="idle" if st == IDLE else "still sending its request",
                                  seconds=now - since, max=self.limits.max_waiting_connections))
        _shut(pick)
        return True


def _shut(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)  # its thread's recv returns at once; the thread leaves
    except OSError:
        pass


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
        self.log_requests = True  # one access-log line per request (--disable-log-requests turns it off)
        self.closing = False  # a drain stopped accepting: no keep-alive past the current request
        self.threads = WorkerThreads("wcache-http", start_idle=0)  # connections, and streamed completions
        threading.Thread(target=self.threads.prestart, args=(START_IDLE,), name="wcache-http-prestart",
                         daemon=True).start()
        # A decoding thread holds the GIL for up to the switch interval (5 ms) each time a request's
        # thread asks for it, and a probe's answer asks a dozen times: 1 ms keeps /health's p99 low
        # while completions decode (wcache bench --health-under-load measures it).
        sys.setswitchinterval(min(sys.getswitchinterval(), SWITCH_INTERVAL_S))
        try:
            super().__init__(address, handler, bind_and_activate=sock is None)
        except OSError as e:  # e.g. port 8000 taken: one line and status 2, not a traceback
            raise address_error(e, address) from None
        if sock is not None:  # a listening socket bound by another process (a supervisor owning the port)
            self.socket.close()
            self.socket = sock
            self.server_address = sock.getsockname()
            self.server_name, self.server_port = self.server_address[:2]

    def wait_arrived(self, timeout: float) -> bool:
        """Wait, at most ``timeout`` seconds, while requests are arriving: connections waiting to be
        accepted, new ones whose first request is not read yet, requests being read. True once none
        is. An idle engine's scheduler asks before its first step (scheduler.py, ``ARRIVAL_WAIT_S``)."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            try:
                backlog = bool(select.select([self.socket], [], [], 0)[0])
            except (OSError, ValueError):  # closed: nothing more arrives
                backlog = False
            arriving = self.connections.arriving(min(left, 0.001))  # waits a moment only if one is
            if not arriving and not backlog:
                return True
            if not arriving:  # only the backlog, which changes no state here: look again shortly
                time.sleep(min(left, 0.0005))

    def process_request(self, request, client_address):
        """A thread per connection, at most ``max_waiting_connections`` waiting: past that, room is
        made or a 503. Nothing here waits: the accept loop must keep accepting probes."""
        if not self.connections.admit(request):
            try:
                request.settimeout(1.0)
                body = json.dumps(error_body(503, BUSY_MESSAGE.format(
                    max=self.limits.max_waiting_connections))).encode()
                request.sendall(b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                                b"Retry-After: %d\r\nConnection: close\r\nContent-Length: %d\r\n\r\n%s"
                                % (BUSY_RETRY_AFTER_S, len(body), body))
            except OSError:
                pass
            self.shutdown_request(request)
            return
        self.threads.submit(self.process_request_thread, request, client_address)

    def server_close(self) -> None:
        super().server_close()
        self.threads.close()

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.connections.forget(request)

    def handle_error(self, request, client_address):
        if isinstance(sys.exc_info()[1], OSError):
            return  # the client gave up or was closed to make room: not worth a traceback
        super().handle_error(request, client_address)


class FrontDoorHandler(BaseHTTPRequestHandler):
    """Reads each request under its deadline and checks its framing; routes are ``do_GET`` etc.,
    the health lane's ``answer_lane`` (GET and HEAD of ``LANE_PATHS``)."""

    server: FrontDoorServer
    protocol_version = "HTTP/1.1"
    # TCP_NODELAY, as uvicorn (vLLM's server) sets it: a stream is many small writes, and with
    # Nagle's algorithm each one after the first waited for the client's delayed ACK. On a
    # keep-alive connection a streamed max_tokens=1 completion took 48 ms instead of 6.
    disable_nagle_algorithm = True
    record: RequestRecord | None = None

    def setup(self) -> None:
        super().setup()
        self.limits = self.server.limits
        self.rfile = DeadlineReader(self.connection, self.limits)

    def handle_one_request(self) -> None:
        conns, reader = self.server.connections, self.rfile
        self.record = None
        if self.server.closing or not conns.mark(self.connection, IDLE):
            self.close_connection = True
            return
        if not reader.wait_for_request(self.limits.idle_timeout_s):
            self.close_connection = True
            return
        if not conns.mark(self.connection, ARRIVING, reader):
            self.close_connection = True
            return
        started = time.monotonic()
        reader.deadline = started + self.limits.request_deadline_s
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
            self.record = RequestRecord(request_id(self.headers.get(REQUEST_ID_HEADER)), self.command, self.path,
                                        started)
            if self.server.closing:
                self.close_connection = True  # draining: this answer is the connection's last
            problem = framing_problem(self.headers)
            if problem:
                self.close_connection = True
                self.send_json(400, error_body(400, problem))
                return
            if self.command != "POST" and (self.headers.get("Content-Length") or self.headers.get("Transfer-Encoding")):
                self.close_connection = True  # only POST reads a body: the rest must not be read as a request
            if self.path in LANE_PATHS:
                self._lane()
            else:
                method = getattr(self, "do_" + self.command, None)
                if method is None:
                    self.send_error(501, f"Unsupported method ({self.command!r})")
                    return
                method()
            self.wfile.flush()
        except Refused as e:
            self.close_connection = True
            self.send_json(e.status, error_body(e.status, e.message),
                           headers={"Retry-After": str(BUSY_RETRY_AFTER_S)} if e.status == 503 else None)
        except TimeoutError:  # the deadline, or one read that waited too long
            self.close_connection = True
            try:
                self.send_json(408, error_body(408, TIMED_OUT.format(deadline=self.limits.request_deadline_s,
                                                                      read=self.limits.read_timeout_s)))
            except OSError:
                pass
        finally:
            reader.deadline = None
            self.server.connections.handed(self.connection)
            if self.record is not None and self.server.log_requests:
                access_log.info(self.record.line())

    def _lane(self) -> None:
        """``/health``, ``/metrics``, ``/version``: on the lane's own budget, never the completions'."""
        self.begin_answer(LANE)
        if self.command not in LANE_METHODS:
            self.close_connection = True
            self.send_json(405, error_body(405, NOT_ALLOWED.format(method=self.command, path=self.path)),
                           headers={"Allow": ", ".join(LANE_METHODS)})
            return
        self.answer_lane()

    def answer_lane(self) -> None:
        raise NotImplementedError

    def read_body(self, length: int) -> bytes:
        """The body (under the request's deadline, like the head); a short one means the peer closed."""
        return self.rfile.read(length)

    def begin_answer(self, budget: str = WORKING) -> None:
        """The request is read: it takes a slot of ``budget`` (else ``Refused``, a 503), and from
        here on only writes wait, each at most ``write_timeout_s``."""
        self.rfile.deadline = None
        if not self.server.connections.work(self.connection, budget):
            if budget == LANE:
                raise Refused(503, LANE_BUSY.format(max=self.limits.health_connections))
            raise Refused(503, BUSY_MESSAGE.format(max=self.limits.max_connections))
        self.connection.settimeout(self.limits.write_timeout_s)

    def send_response(self, code, message=None):
        super().send_response(code, message)
        if self.record is not None:
            self.record.status = code
            self.send_header(REQUEST_ID_HEADER, self.record.request_id)

    def send_error(self, code, message=None, explain=None):
        """The standard library's own refusals (bad request line, headers too long) as JSON."""
        self.close_connection = True
        if getattr(self, "request_version", "HTTP/0.9") in ("HTTP/0.9", ""):
            self.request_version = "HTTP/1.0"  # an unparsable request line still gets a status line
        try:
            self.send_json(code, error_body(code, message or self.responses.get(code, ("Error",))[0]))
        except OSError:
            pass

    def send_json(self, status: int, payload: dict, headers: dict | None = None) -> None:
        self.send_bytes(status, json.dumps(payload).encode(), "application/json", headers)

    def send_bytes(self, status: int, body: bytes, content_type: str, headers: dict | None = None) -> None:
        """An answer with a body; to a HEAD, the same head without the body."""
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        if self.close_connection:
            self.send_header("Connection", "close")
        self._answer_body = body if self.command != "HEAD" else b""
        self.end_headers()  # the head and the body in one write (flush_headers)
        if self._answer_body:  # no head was flushed (HTTP/0.9 has none)
            body, self._answer_body = self._answer_body, b""
            self.wfile.write(body)

    def flush_headers(self) -> None:
        """The head, and a whole answer's body with it: one write, so a --respawn worker that dies
        around it has written either nothing of the answer or all of it (engine/respawn/reception.py)."""
        body, self._answer_body = getattr(self, "_answer_body", b""), b""
        if getattr(self, "_headers_buffer", None):
            self.wfile.write(b"".join(self._headers_buffer) + body)
            self._headers_buffer = []
        elif body:
            self.wfile.write(body)

    def log_message(self, fmt, *args):  # the standard library's own log lines: quietly, at DEBUG
        log.debug("%s " + fmt, self.address_string(), *args)


def framing_problem(headers) -> str | None:
    lengths = headers.get_all("Content-Length") or []
    if headers.get("Transfer-Encoding") is not None and lengths:
        return BOTH_FRAMINGS
    if len(lengths) > 1 or any("," in v for v in lengths):
        return MANY_LENGTHS
    return None
