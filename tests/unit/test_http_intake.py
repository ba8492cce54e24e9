"""The HTTP front door's intake, on real loopback sockets: which requests count as arriving (an idle
engine's first step waits for them, scheduler.py) and the reused handler threads. (Small writes
sent at once, TCP_NODELAY: tests/faults/test_fault_http.py, against a real engine.)"""

from __future__ import annotations

import socket
import threading
import time

import pytest
from wcache.engine.api_server.http_front import ARRIVING, FRESH_S, IDLE, WORKING, Connections, Limits
from wcache.engine.api_server.server import EngineServer
from wcache.engine.api_server.worker_threads import WorkerThreads


@pytest.fixture
def server():
    s = EngineServer(("127.0.0.1", 0), None, "m")
    s.ready = True
    yield s
    s.shutdown()
    s.server_close()


def until(predicate, seconds: float = 2.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.001)
    return False


@pytest.mark.timed  # its bound holds on an idle host: make test runs it alone
def test_a_new_connection_and_a_request_being_read_count_as_arriving(server):
    assert not server.connections.arriving()
    c = socket.create_connection(server.server_address)
    try:
        # Accepted and silent: arriving for FRESH_S, then no longer (a pool's spare connection).
        assert until(lambda: server.connections.arriving(), FRESH_S)
        assert until(lambda: not server.connections.arriving())
        c.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # a head not finished yet
        assert until(lambda: server.connections.arriving())
        t0 = time.monotonic()
        assert server.wait_arrived(0.05) is False  # waited its whole bound: the request still arrives
        assert time.monotonic() - t0 >= 0.05
        c.sendall(b"\r\n")
        assert c.recv(4096).startswith(b"HTTP/1.1 200")
        assert until(lambda: not server.connections.arriving())
        t0 = time.monotonic()
        assert server.wait_arrived(1.0) is True
        assert time.monotonic() - t0 < 0.5  # nothing arriving: no wait
    finally:
        c.close()


def test_a_read_request_arrives_until_it_is_handed_to_the_engine():
    """After its head and body are read, a request is parsed and tokenized before it reaches the
    engine's queue: it counts as arriving until then (else a burst's first step could start
    without it), and no longer once handed, or once its connection is idle again."""
    conns = Connections(Limits())
    a, b = socket.socketpair()
    try:
        assert conns.admit(a)
        assert conns.mark(a, ARRIVING) and conns.arriving()
        assert conns.work(a, WORKING)
        assert conns.arriving()  # working on it, not yet in the engine's queue
        conns.handed(a)
        assert not conns.arriving()
        assert conns.mark(a, ARRIVING) and conns.work(a, WORKING) and conns.arriving()
        assert conns.mark(a, IDLE) and not conns.arriving()  # answered without the engine (an error, a GET)
    finally:
        a.close()
        b.close()


def test_worker_threads_are_reused_and_leave_when_closed():
    """Ten jobs one after another run on the two threads started idle: no thread is created for
    them. Counted by Thread objects, each kept alive here so none can stand for another (thread
    idents are reused by the OS once a thread ends: a new thread per job could show two idents).
    The break it catches: a thread per job (``submit`` always ``_start``s)."""
    created = []
    start = threading.Thread.start

    def counted_start(t):  # every thread the pool creates, counted as it starts
        created.append(t)
        start(t)

    threading.Thread.start = counted_start
    try:
        pool = WorkerThreads("test-pool", start_idle=2)
        idle = list(created)
        seen, done = [], threading.Semaphore(0)

        def job(i):
            seen.append((i, threading.current_thread()))
            done.release()

        for i in range(10):  # one after another: an idle thread takes each
            pool.submit(job, i)
            assert done.acquire(timeout=5)
    finally:
        threading.Thread.start = start
    assert len(idle) == 2 and created == idle, created  # none created after the two idle ones
    assert {id(t) for _, t in seen} <= {id(t) for t in idle}, seen
    threads = [t for t in threading.enumerate() if t.name == "test-pool"]
    pool.close()
    for t in threads:
        t.join(5)
    assert not any(t.is_alive() for t in threads)
