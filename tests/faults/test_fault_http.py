"""The engine's HTTP front door under attack, over real sockets (issue api-1): headers trickled in
to hold connections, ambiguous framing (Transfer-Encoding with Content-Length, two lengths), and
idle keep-alive connections held to starve new clients.

The attacks on the limits run against an in-process ``EngineServer`` whose limits are shortened
(seconds, not the defaults' tens of seconds), so the suite stays fast; the defaults' own values are
attacked once each against a real ``wcache serve``. What each attack costs legitimate clients is
measured and recorded (attacklib.figure -> docs/faults-attacks.json, shown in docs/faults.md).
"""

from __future__ import annotations

import logging
import re
import socket
import threading
import time

import pytest
from attacklib import figure
from procs import http
from wcache.engine.api_server.http_front import BOTH_FRAMINGS, DEFAULT_LIMITS, MANY_LENGTHS, TIMED_OUT, Limits
from wcache.engine.api_server.server import EngineServer

NO_TUNE = "--no-enable-autotune"
GET_HEALTH = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"


@pytest.fixture(scope="module")
def engine(fault_procs, tiny_model):
    return fault_procs.serve(tiny_model, NO_TUNE)


def small_server(**limits) -> EngineServer:
    """A real HTTP server on a free loopback port, its engine not needed: GET /health is 200."""
    server = EngineServer(("127.0.0.1", 0), None, "m", limits=Limits(**limits))
    server.ready = True
    return server


def stop(server: EngineServer) -> None:
    server.shutdown()
    server.server_close()


def read_answers(s: socket.socket, timeout: float = 10) -> bytes:
    """Everything the server sends until it closes the connection (or ``timeout``)."""
    s.settimeout(timeout)
    data = b""
    try:
        while chunk := s.recv(1 << 16):
            data += chunk
    except (TimeoutError, ConnectionResetError):
        pass
    return data


def closed_within(s: socket.socket, timeout: float) -> bool:
    """True when the server closes the connection within ``timeout`` (after any answer it sends)."""
    deadline = time.monotonic() + timeout
    try:
        while (left := deadline - time.monotonic()) > 0:
            s.settimeout(left)
            if s.recv(1 << 16) == b"":
                return True
    except TimeoutError:
        return False
    except OSError:
        return True
    return False


def status_of(port: int) -> int | None:
    """A legitimate client's GET /health: its status, or None when refused at the socket."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            s.sendall(GET_HEALTH)
            head = s.recv(1 << 16)
        return int(head.split(b" ", 2)[1]) if head else None
    except OSError:
        return None


class Trickler:
    """``n`` attacker threads, each opening a connection, holding it with ``_hold`` until the server
    lets go, then reconnecting (after ``pause`` s); ``connections`` counts the connections made."""

    def __init__(self, port: int, n: int, every: float, pause: float = 0.0):
        self.port, self.n, self.every, self.pause = port, n, every, pause
        self.connections = 0
        self.stopping = threading.Event()
        self.threads = [threading.Thread(target=self._attacker, daemon=True) for _ in range(n)]

    def _hold(self, s: socket.socket) -> None:
        raise NotImplementedError

    def _attacker(self) -> None:
        while not self.stopping.is_set():
            try:
                s = socket.create_connection(("127.0.0.1", self.port), timeout=5)
            except OSError:
                time.sleep(0.05)
                continue
            self.connections += 1
            try:
                self._hold(s)
            except OSError:
                pass
            finally:
                s.close()
            self.stopping.wait(self.pause)

    def _trickle(self, s: socket.socket, piece) -> None:
        """Send ``piece(i)`` every ``every`` s until the server answers or closes (a 408 or a 503)."""
        i = 0
        while not self.stopping.is_set():
            s.settimeout(self.every)
            try:
                s.recv(1 << 16)
                return  # an answer or the close: the server let go of it
            except TimeoutError:
                pass
            s.sendall(piece(i))
            i += 1

    def __enter__(self):
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stopping.set()
        for t in self.threads:
            t.join(self.every + 5)


class Slowloris(Trickler):
    """Connections each sending a request line then one header line every ``every`` s: how long
    each connection was held is kept."""

    def __init__(self, port: int, n: int, every: float):
        super().__init__(port, n, every)
        self.held: list[float] = []

    def _hold(self, s: socket.socket) -> None:
        t0 = time.monotonic()
        try:
            s.sendall(b"GET /health HTTP/1.1\r\n")
            self._trickle(s, lambda i: b"X-Slow-%d: y\r\n" % i)
        finally:
            if not self.stopping.is_set():
                self.held.append(time.monotonic() - t0)


def legit_during(port: int, seconds: float) -> list[tuple[float, int | None]]:
    """GET /health every 0.1 s for ``seconds``: (time, status) of each."""
    out, t0 = [], time.monotonic()
    while time.monotonic() - t0 < seconds:
        out.append((time.monotonic() - t0, status_of(port)))
        time.sleep(0.1)
    return out


def longest_refusal(results: list[tuple[float, int | None]]) -> float:
    """The longest time legitimate requests kept failing in a row (0 when none failed)."""
    longest, since = 0.0, None
    for t, status in results:
        if status != 200:
            since = t if since is None else since
            longest = max(longest, t - since)
        else:
            since = None
    return longest


# -- 1. headers trickled in ---------------------------------------------------------------------
@pytest.mark.slow
def test_64_slow_header_senders_hold_no_slot_past_the_deadline_and_clients_are_served():
    """The issue's attack, time scaled by 10: 64 connections (every slot) each send a header line
    every 0.5 s, reconnecting when cut; the deadline is 3 s. Legitimate GETs meanwhile."""
    limits = dict(request_deadline_s=3.0, read_timeout_s=2.0, head_grace_s=1.0)
    server = small_server(**limits)
    port = server.server_address[1]
    try:
        with Slowloris(port, DEFAULT_LIMITS.max_connections, every=0.5) as attack:
            time.sleep(1.5)  # every slot taken
            results = legit_during(port, 8.0)
        served = sum(1 for _, s in results if s == 200)
        assert attack.held, "the attackers never got a connection"
        assert max(attack.held) <= limits["request_deadline_s"] + 1.0, max(attack.held)
        gap = longest_refusal(results)
        assert served >= 0.9 * len(results) and gap <= limits["head_grace_s"] + 1.0, (served, len(results), gap)
    finally:
        stop(server)
    figure("slow HTTP headers (shortened deadline)", deadline_s=limits["request_deadline_s"], attackers=DEFAULT_LIMITS.max_connections,
           header_every_s=0.5, longest_hold_s=max(attack.held), legit_requests=len(results), legit_served=served,
           longest_refusal_s=gap)


def trickle_headers(port: int, request_line: bytes, every: float) -> tuple[bytes, float]:
    """Send a request line, then a header line every ``every`` s until the server answers (or 60
    lines): (the answer, seconds from the first byte)."""
    with socket.create_connection(("127.0.0.1", port)) as s:
        t0 = time.monotonic()
        s.sendall(request_line)
        s.settimeout(every)
        for i in range(60):
            try:
                first = s.recv(1 << 16)
                seconds = time.monotonic() - t0
                # the rest of the answer: its head and body may come in two segments, then the close
                return first + read_answers(s, timeout=5), seconds
            except TimeoutError:
                s.sendall(b"X-%d: y\r\n" % i)
    return b"", time.monotonic() - t0


def test_a_request_trickled_in_is_cut_at_its_deadline_from_the_first_byte():
    server = small_server(request_deadline_s=2.0, read_timeout_s=5.0)
    try:
        # a header line every 0.4 s, each read well within the read timeout
        answer, seconds = trickle_headers(server.server_address[1], b"GET /health HTTP/1.1\r\n", every=0.4)
        assert answer.startswith(b"HTTP/1.1 408 "), answer
        assert TIMED_OUT.format(deadline=2.0, read=5.0).encode() in answer
        assert 2.0 <= seconds <= 3.0, seconds
    finally:
        stop(server)


@pytest.mark.slow  # waits out the default deadline (30 s)
def test_the_default_deadline_is_30_s_against_wcache_serve(engine):
    assert DEFAULT_LIMITS.request_deadline_s == 30.0  # docs/security.md promises it
    # a header line every 5 s: the attack, one connection of it
    answer, seconds = trickle_headers(engine.port, b"POST /v1/completions HTTP/1.1\r\n", every=5.0)
    assert answer.startswith(b"HTTP/1.1 408 "), answer
    assert 30.0 <= seconds <= 31.5, seconds
    assert http("GET", f"http://127.0.0.1:{engine.port}/health")[0] == 200
    figure("slow HTTP headers (default deadline)", header_every_s=5, closed_after_s=seconds)


# -- 2. ambiguous framing ----------------------------------------------------------------------------
SMUGGLED = b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n"
FRAMING = {  # name: (request bytes whose tail would be a second request if misread, message)
    "Transfer-Encoding and Content-Length": (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\nContent-Length: 4\r\n\r\n"
        b"0\r\n\r\n" + SMUGGLED, BOTH_FRAMINGS),
    "two different Content-Lengths": (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nContent-Length: 40\r\n\r\n{}" + SMUGGLED,
        MANY_LENGTHS),
    "two equal Content-Lengths": (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nContent-Length: 2\r\n\r\n{}" + SMUGGLED,
        MANY_LENGTHS),
    "a list as Content-Length": (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2, 40\r\n\r\n{}" + SMUGGLED, MANY_LENGTHS),
    "a GET with both": (
        b"GET /health HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\nContent-Length: 2\r\n\r\n{}" + SMUGGLED,
        BOTH_FRAMINGS),
}


@pytest.mark.parametrize("case", list(FRAMING))
def test_ambiguous_framing_is_a_400_and_nothing_after_it_is_served(engine, case):
    data, message = FRAMING[case]
    with socket.create_connection(("127.0.0.1", engine.port)) as s:
        s.sendall(data)
        answer = read_answers(s)
    assert answer.startswith(b"HTTP/1.1 400 "), answer[:200]
    assert message.encode() in answer and b"Connection: close" in answer
    assert answer.count(b"HTTP/1.1 ") == 1, answer  # the smuggled GET was never read as a request
    assert http("GET", f"http://127.0.0.1:{engine.port}/health")[0] == 200


def test_a_get_with_a_body_closes_the_connection_instead_of_reading_the_body_as_a_request(engine):
    with socket.create_connection(("127.0.0.1", engine.port)) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(SMUGGLED) + SMUGGLED)
        answer = read_answers(s)
    assert answer.startswith(b"HTTP/1.1 200 ") and answer.count(b"HTTP/1.1 ") == 1, answer


# -- 3. idle keep-alive connections --------------------------------------------------------------------
def keep_alive_connections(port: int, n: int, with_request: bool) -> list[socket.socket]:
    """``n`` connections left idle: after one answered request each, or without sending a byte."""
    held = []
    for _ in range(n):
        s = socket.create_connection(("127.0.0.1", port), timeout=10)
        if with_request:
            s.sendall(GET_HEALTH)
            assert read_one_answer(s).startswith(b"HTTP/1.1 200 ")
        held.append(s)
    return held


def read_one_answer(s: socket.socket) -> bytes:
    """One whole answer, head and body (by its Content-Length): the server may send them in two
    segments, and a byte left unread would look like a second answer to the next read."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = s.recv(1 << 16)
        assert chunk, f"closed after {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(re.search(rb"(?im)^content-length:\s*(\d+)", head).group(1))
    while len(body) < length:
        chunk = s.recv(1 << 16)
        assert chunk, f"closed after {data!r}"
        body += chunk
    return head + b"\r\n\r\n" + body


@pytest.mark.parametrize("with_request", [True, False], ids=["after a request", "silent"])
def test_idle_connections_make_room_for_new_clients(with_request, caplog):
    caplog.set_level(logging.INFO, logger="wcache.server")
    server = small_server(idle_timeout_s=600.0, max_waiting_connections=8)  # only making room can free a slot
    port = server.server_address[1]
    held = keep_alive_connections(port, 8, with_request)
    try:
        time.sleep(DEFAULT_LIMITS.head_grace_s + 0.2)  # idle for longer than a newcomer's grace
        t0 = time.monotonic()
        statuses = [status_of(port) for _ in range(20)]
        seconds = (time.monotonic() - t0) / 20
        assert statuses == [200] * 20 and seconds < 1.0, (statuses, seconds)
        closed = sum(1 for s in held if read_answers(s, timeout=0.2) == b"")
        assert closed >= 1  # the idle ones were closed for them, longest-idle first
        assert "s to make room for a new one (8 in use)" in caplog.text  # ROOM_MADE, in the engine's log
    finally:
        for s in held:
            s.close()
        stop(server)


def test_an_idle_keep_alive_connection_is_closed_after_the_idle_timeout():
    server = small_server(idle_timeout_s=0.5)
    try:
        [s] = keep_alive_connections(server.server_address[1], 1, with_request=True)
        t0 = time.monotonic()
        assert read_answers(s, timeout=5) == b""
        assert 0.4 <= time.monotonic() - t0 <= 1.5
        s.close()
    finally:
        stop(server)


def test_one_more_idle_connection_than_waiting_slots_does_not_starve_a_client(engine):
    """The issue's attack at the defaults: one more idle connection than there are waiting slots."""
    n = DEFAULT_LIMITS.max_waiting_connections + 1
    held = keep_alive_connections(engine.port, n, with_request=False)
    try:
        time.sleep(DEFAULT_LIMITS.head_grace_s + 0.2)
        t0 = time.monotonic()
        results = [status_of(engine.port) for _ in range(10)]
        seconds = time.monotonic() - t0
        assert results == [200] * 10 and seconds < 5, (results, seconds)
        t1 = time.monotonic()  # the rest are closed by the idle timeout (5 s)
        open_after = [s for s in held if not closed_within(s, DEFAULT_LIMITS.idle_timeout_s + 3)]
        idle_closed_s = time.monotonic() - t1
        assert not open_after
    finally:
        for s in held:
            s.close()
    figure("idle HTTP connections", connections=n, legit_requests=10, legit_served=results.count(200),
           legit_total_s=seconds, all_closed_within_s=idle_closed_s)


# -- 4. a listening socket handed in (a supervisor that owns the port) ---------------------------------
def test_a_server_serves_on_a_listening_socket_it_is_handed():
    listener = socket.create_server(("127.0.0.1", 0))
    server = EngineServer(("127.0.0.1", 0), None, "m", sock=listener)
    server.ready = True
    try:
        assert server.server_address == listener.getsockname()
        assert status_of(listener.getsockname()[1]) == 200
    finally:
        stop(server)
    assert listener.fileno() == -1  # the server closed what it was handed


# -- 5. bodies trickled in (issue ops-1) ---------------------------------------------------------------
class SlowBodies(Trickler):
    """Connections that send a completion's headers, then one body byte every ``every`` s, and
    reconnect (after ``pause`` s) when the server cuts them: the issue's attack at a93be40."""

    def _hold(self, s: socket.socket) -> None:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 4096\r\n\r\n")
        self._trickle(s, lambda i: b" ")


def legit_completion(port: int) -> int:
    status, _ = http("POST", f"http://127.0.0.1:{port}/v1/completions", {"prompt": "Hello", "max_tokens": 4},
                     timeout=30)
    return status


def test_64_slow_body_senders_do_not_starve_completions(engine):
    """The issue's attack against wcache serve at its defaults (a body byte every 0.5 s instead of
    5 s, so the connections stay as slow and the suite stays short): 12 legitimate completions, one
    a second, each a 200. At a93be40, 9 of 12 were a 503."""
    with SlowBodies(engine.port, 64, every=0.5) as attack:
        time.sleep(1.5)  # every attacker connected and mid-body
        statuses = []
        for _ in range(12):
            statuses.append(legit_completion(engine.port))
            time.sleep(1.0)
    assert attack.connections >= 64
    assert statuses == [200] * 12, statuses
    figure("slow HTTP bodies", attackers=64, body_byte_every_s=0.5, legit_completions=12,
           legit_served=statuses.count(200))


def test_when_waiting_slots_run_out_the_slowest_body_sender_is_shed(caplog):
    """More tricklers than waiting slots: a legitimate request still gets in, because a connection
    delivering its body slower than any other for over the grace is closed to make room for it.
    The rule's bound: it holds while the attackers reconnect slower than the slots age past the
    grace (16 slots / 0.5 s here); a flood of reconnections faster than that takes every slot as
    it ages, which only more slots (the default is 256) answer."""
    caplog.set_level(logging.INFO, logger="wcache.server")
    server = small_server(max_waiting_connections=16, head_grace_s=0.5)
    port = server.server_address[1]
    try:
        with SlowBodies(port, 24, every=0.3, pause=2.0):
            time.sleep(1.0)
            statuses = []
            for _ in range(12):
                statuses.append(http("GET", f"http://127.0.0.1:{port}/v1/models", timeout=10)[0])
                time.sleep(0.3)
        assert statuses == [200] * 12, statuses
        assert "still sending its request for" in caplog.text and "(16 in use)" in caplog.text
    finally:
        stop(server)

