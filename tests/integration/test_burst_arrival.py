"""An idle engine's first step and the requests still arriving (engine/core/scheduler.py's burst wait,
engine/api_server/server.py's arrival mark), over real loopback HTTP to an engine and its server in this
process, wired as ``wcache serve`` wires them (engine.run_serve: the scheduler asks the server's
``wait_arrived``).

What is asserted is what the wait returned (True: nothing was arriving any more; False: it waited
its whole bound) and how many engine steps the requests took, never how many milliseconds: the
bound is raised for the test where a slow machine could otherwise make a late request miss it.
"""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.request

import pytest
from wcache.core.checkpoint import make_checkpoint
from wcache.core.config import EngineConfig
from wcache.engine.core import scheduler
from wcache.engine.core.engine import Engine
from wcache.engine.worker.runner import EngineOptions
from wcache.engine.api_server.server import EngineServer


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    ckpt = make_checkpoint(tmp_path_factory.mktemp("burst") / "tiny", "tiny")
    eng = Engine.start(EngineConfig.build(str(ckpt), "auto", None, "cpu"),
                       EngineOptions("safetensors", enable_autotune=False, max_num_seqs=4))
    yield eng
    eng.close()


@pytest.fixture
def served(engine):
    """(server, what each burst wait returned): the server wired to the engine as run_serve does."""
    server = EngineServer(("127.0.0.1", 0), engine, "m")
    server.engine, server.ready = engine, True
    waits = []

    def wait_arrived(timeout):
        waits.append(server.wait_arrived(timeout))
        return waits[-1]

    engine.scheduler.wait_arrived = wait_arrived
    server.metrics.engine_ready(engine)
    yield server, waits
    engine.scheduler.wait_arrived = None
    server.shutdown()
    server.server_close()


def body(prompt: str = "Hello", max_tokens: int = 1) -> bytes:
    return json.dumps({"prompt": prompt, "max_tokens": max_tokens}).encode()


def post(port: int, prompt: str = "Hello") -> dict:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body(prompt),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.load(r)


def test_a_lone_request_is_not_waited_for_once_it_is_in_the_queue(served, engine, monkeypatch):
    """Its own connection stops counting as arriving when its request is queued, so the burst
    wait finds nothing arriving and the step starts. The bound is 5 s here: had the wait run to
    it, it would return False.
    The break it catches: the arrival mark unwired (server.py not passing ``queued``): the
    request's own connection counts as arriving until it is answered, and every lone request
    waited the whole bound (20 ms in a real server)."""
    server, waits = served
    monkeypatch.setattr(scheduler, "ARRIVAL_WAIT_S", 5.0)
    for _ in range(3):
        assert post(server.server_address[1])["usage"]["completion_tokens"] == 1
    assert waits == [True, True, True]


def test_a_request_still_arriving_shares_the_idle_engines_first_step(served, engine, monkeypatch):
    """One connection has sent half its head (a request arriving) when another request reaches an
    idle engine: the first step waits for it, so both prompts run in one step. The half request
    is finished once the first is seen waiting in the queue (and still there 0.3 s later), well
    inside the (raised) bound.
    The break it catches: the burst wait off (the scheduler not asking ``wait_arrived``): the
    first request ran alone and the second took a step of its own (2 steps)."""
    server, waits = served
    port = server.server_address[1]
    monkeypatch.setattr(scheduler, "ARRIVAL_WAIT_S", 5.0)
    late = socket.create_connection(("127.0.0.1", port), timeout=60)
    try:
        late.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # the head, not finished
        steps = engine.stats.steps
        first = {}
        sender = threading.Thread(target=lambda: first.update(r=post(port)))
        sender.start()
        deadline = time.monotonic() + 30
        while engine.num_requests_waiting() != 1:  # the first one is queued, and held there
            assert time.monotonic() < deadline and sender.is_alive()
            time.sleep(0.005)
        sender.join(0.3)
        assert sender.is_alive() and engine.num_requests_waiting() == 1  # held by the wait
        b = body()
        late.sendall(b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(b), b))
        answer = late.makefile("rb").readline()
        sender.join(60)
    finally:
        late.close()
    assert answer.startswith(b"HTTP/1.1 200") and first["r"]["usage"]["completion_tokens"] == 1
    assert engine.stats.steps - steps == 1  # one step gave both their token
    assert waits == [True]


def test_the_wait_is_bounded_when_a_request_never_finishes_arriving(served, engine):
    """A connection that sends half a head and nothing more does not hold the engine: after the
    real bound (ARRIVAL_WAIT_S) the step runs without it, and the wait says it ran out."""
    server, waits = served
    port = server.server_address[1]
    stalled = socket.create_connection(("127.0.0.1", port), timeout=60)
    try:
        stalled.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        assert post(port)["usage"]["completion_tokens"] == 1
    finally:
        stalled.close()
    assert waits == [False]
