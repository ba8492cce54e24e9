"""What an operator checks before a rollout (issue ops-1), over real sockets against real
`wcache serve` processes: the health lane outside the completion limit, HEAD /health, /version,
/metrics' methods and its answer on the lane, X-Request-Id and the access log, completions that stop when their client
leaves, and the SIGTERM drain's phases (also under --respawn)."""

from __future__ import annotations

from http.client import HTTPConnection
import json
import re
import signal
import socket
import threading
import time
import urllib.request

import pytest
from procs import complete, http, two_processes, wait_until
from wcache.engine.api_server.access_log import CLIENT_CLOSED
from wcache.errors import BUSY_MESSAGE, NOT_ALLOWED, SHUTTING_DOWN

LIMIT = 4  # --max-concurrent-connections of the module's engine
LONG = 500  # tokens: seconds of decoding for the tiny model on a CPU


@pytest.fixture(scope="module")
def engine(module_procs, tiny_model):
    return module_procs.serve(tiny_model, "--no-enable-autotune", "--max-concurrent-connections", str(LIMIT))


def request(port: int, method: str, path: str, body: bytes | None = None, headers: dict | None = None):
    """(status, headers, body bytes) of one request on its own connection."""
    conn = HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        r = conn.getresponse()
        return r.status, r.headers, r.read()
    finally:
        conn.close()


def completion_body(max_tokens: int, stream: bool = False, **fields) -> bytes:
    return json.dumps({"prompt": "Hello", "max_tokens": max_tokens, "stream": stream, **fields}).encode()


def held_requests(port: int) -> int:
    """Running plus waiting requests, as the engine's /metrics counts them."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    gauges = re.findall(r"^vllm:num_requests_(?:running|waiting)\{[^}]*\} ([0-9.]+)$", text, re.M)
    return int(sum(float(g) for g in gauges))


def post_head(body: bytes) -> bytes:
    return b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(body)


def open_stream(port: int, max_tokens: int = LONG, **fields) -> socket.socket:
    """A streamed completion whose answer is not read: it holds one of the completion slots."""
    s = socket.create_connection(("127.0.0.1", port), timeout=30)
    body = completion_body(max_tokens, stream=True, **fields)
    s.sendall(post_head(body) + body)
    return s


def access_lines(engine) -> list[str]:
    return [line for line in engine.log().splitlines() if "[wcache.access] request " in line]


def test_head_health_answers_like_get_without_a_body(engine):
    status, headers, body = request(engine.port, "HEAD", "/health")
    assert status == 200 and body == b""
    assert headers["Content-Length"] == str(len(json.dumps({"status": "ok"})))  # GET's length, as RFC 9110 asks
    assert http("GET", f"http://127.0.0.1:{engine.port}/health") == (200, {"status": "ok"})


def test_version_names_what_runs(engine):
    import torch
    import wcache

    status, body = http("GET", f"http://127.0.0.1:{engine.port}/version")
    assert status == 200 and set(body) == {"version", "commit", "torch", "device"}
    assert body["version"] == wcache.__version__ and body["torch"] == torch.__version__ and body["device"] == "cpu"
    assert body["commit"] is None or re.fullmatch(r"[\w.-]+", body["commit"])  # git describe, from a checkout


@pytest.mark.parametrize("method", ["POST", "PUT", "DELETE", "PATCH"])
def test_the_health_lane_answers_other_methods_405(engine, method):
    for path in ("/metrics", "/health", "/version"):
        status, headers, body = request(engine.port, method, path, body=b"{}")
        assert status == 405, (path, body)
        assert json.loads(body)["error"]["message"] == NOT_ALLOWED.format(method=method, path=path)
        assert headers["Allow"] == "GET, HEAD"
    assert http("GET", f"http://127.0.0.1:{engine.port}/health")[0] == 200


def test_a_valid_request_id_is_echoed_and_logged(engine):
    rid = "trace-0123:abc/XYZ~"
    status, headers, _ = request(engine.port, "POST", "/v1/completions", completion_body(3),
                                 {"X-Request-Id": rid, "Content-Type": "application/json"})
    assert status == 200 and headers["X-Request-Id"] == rid
    deadline = time.monotonic() + 5
    while not (mine := [line for line in access_lines(engine) if f"request {rid} " in line]):
        assert time.monotonic() < deadline, engine.log()[-2000:]
        time.sleep(0.05)
    [line] = mine
    assert re.search(rf"request {re.escape(rid)} POST /v1/completions 200 prompt_tokens=4 generation_tokens=3 "
                     r"ttft_ms=\d+\.\d total_ms=\d+\.\d$", line), line


@pytest.mark.parametrize("given", ["x" * 129, "bad\x01id", "two words", ""], ids=["too long", "control", "space", "empty"])
def test_a_malformed_request_id_is_replaced_not_echoed(engine, given):
    with socket.create_connection(("127.0.0.1", engine.port), timeout=10) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Request-Id: " + given.encode("latin-1") + b"\r\n\r\n")
        head = s.recv(1 << 16).split(b"\r\n\r\n")[0].decode("latin-1")
    assert head.startswith("HTTP/1.1 200 ")
    [echoed] = re.findall(r"(?im)^x-request-id: ([^\r\n]*)", head)
    assert re.fullmatch(r"[0-9a-f]{32}", echoed) and echoed != given


def test_every_answer_carries_a_request_id(engine):
    for method, path in (("GET", "/v1/models"), ("GET", "/nowhere"), ("GET", "/version")):
        _, headers, _ = request(engine.port, method, path)
        assert re.fullmatch(r"[0-9a-f]{32}", headers["X-Request-Id"]), (method, path)


def test_health_answers_200_while_the_completion_budget_is_exhausted(engine):
    """Every completion slot held by a stream (one decoding, the rest waiting for the engine): a
    completion is refused at once, and the health lane still answers, on new connections."""
    held = [open_stream(engine.port) for _ in range(LIMIT)]
    try:
        for s in held:  # each has its 200 head: every slot is working
            assert s.recv(1 << 16).startswith(b"HTTP/1.1 200 ")
        status, _, body = request(engine.port, "POST", "/v1/completions", completion_body(1))
        assert status == 503 and json.loads(body)["error"]["message"] == BUSY_MESSAGE.format(max=LIMIT)
        for _ in range(20):
            assert request(engine.port, "GET", "/health")[0] == 200
            assert request(engine.port, "HEAD", "/health")[0] == 200
        assert request(engine.port, "GET", "/version")[0] == 200
        assert_metrics_on_the_lane(engine.port)
    finally:
        for s in held:
            s.close()
    wait_served(engine.port)


def assert_metrics_on_the_lane(port: int) -> None:
    """GET /metrics answered, with the budget exhausted, in Prometheus' text format, and what it
    says is the engine's state (tests/integration/test_monitoring.py
    checks each family against a real Prometheus). The break it catches: an engine that does not
    export (no renderer: 404), the test this replaced skipped whenever /metrics answered 200."""
    from prometheus_client.parser import text_string_to_metric_families

    status, headers, body = request(port, "GET", "/metrics")
    assert status == 200 and headers["Content-Type"].startswith("text/plain"), (status, body[:200])
    samples = {s.name: s.value for f in text_string_to_metric_families(body.decode()) for s in f.samples}
    # The streams that hold the budget may have met the checkpoint's EOS by now: the gauge is there,
    # its value is the moment's.
    assert "vllm:num_requests_running" in samples, samples
    assert samples["wcache_engine_ready"] == 1


def wait_served(port: int, timeout: float = 60) -> None:
    """Until a completion is served again (the closed streams have left their slots)."""
    deadline = time.monotonic() + timeout
    while request(port, "POST", "/v1/completions", completion_body(1))[0] != 200:
        assert time.monotonic() < deadline
        time.sleep(0.2)


@pytest.mark.timed  # its bound holds on an idle host: make test runs it alone
def test_a_non_streamed_completion_stops_when_its_client_leaves(engine):
    """Three long completions abandoned by their clients: each stops at its next token (the access
    log says 499 and how many tokens it made). Each client closes as soon as its request is sent,
    so the engine has the request and its client is already gone at its first token: counted in
    tokens, not seconds, a loaded machine cannot fail it.
    The break it catches: the client-gone check made late (from the 300th piece on: 300 tokens
    each, where at most a step's worth may be made)."""
    before = len(access_lines(engine))
    for _ in range(3):
        s = socket.create_connection(("127.0.0.1", engine.port), timeout=10)
        body = completion_body(LONG)
        s.sendall(post_head(body) + body)
        s.close()
    deadline = time.monotonic() + 30
    while len(gone := [line for line in access_lines(engine)[before:] if f" {CLIENT_CLOSED} " in line]) < 3:
        assert time.monotonic() < deadline, access_lines(engine)[before:]
        time.sleep(0.1)
    made = [int(re.search(r"generation_tokens=(\d+)", line).group(1)) for line in gone]
    # Its first piece of text asks, and the sequence leaves before the next step. The engine does not
    # wait for the request's thread, so a thread the machine's load keeps off a core meanwhile lets
    # a few more steps run (alone, [1, 1, 1]): a bound far from the break's 300, and from LONG.
    assert all(1 <= n <= 20 for n in made), made
    assert complete(engine.port, "Hello", 8)["usage"]["completion_tokens"] == 8


# -- the SIGTERM drain --------------------------------------------------------------------------
def test_sigterm_health_503_at_once_new_connections_served_during_the_delay_then_exit_0(module_procs, tiny_model):
    engine = module_procs.serve(tiny_model, "--no-enable-autotune", "--shutdown-delay", "2", "--shutdown-timeout", "5")
    t0 = time.monotonic()
    engine.proc.send_signal(signal.SIGTERM)
    # The handler sets it as the signal is handled: the only wait is the main thread being scheduled.
    while (answer := http("GET", f"http://127.0.0.1:{engine.port}/health")) != (503, {"status": "draining"}):
        assert answer == (200, {"status": "ok"}) and time.monotonic() - t0 < 0.5, answer
        time.sleep(0.01)
    time.sleep(max(0.0, t0 + 0.3 - time.monotonic()))
    assert complete(engine.port, "Hello", 4)["usage"]["completion_tokens"] == 4  # a new connection, served
    assert request(engine.port, "HEAD", "/health")[0] == 503
    assert engine.exit_code(timeout=30) == 0
    seconds = time.monotonic() - t0
    assert 2.0 <= seconds < 10, seconds
    log = engine.log()
    assert "Received SIGTERM, shutting down: /health answers 503; accepting for 2 s more" in log
    assert "Drained in" in log and "Engine stopped" in log
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", engine.port), timeout=2).close()


def test_sigterm_cuts_what_still_runs_at_the_deadline_with_an_error_and_exits_0(module_procs, tiny_model):
    """Five long completions (four plain, one streamed last) on an engine that runs one sequence
    at a time: one runs and four wait, each for hundreds of steps (ignore_eos: a tiny model's EOS
    may come early), so delay 0.5 s and timeout 1 s end with most of them unfinished, however
    fast or loaded the machine. Each of those ends with the drain's error, none without an answer."""
    delay, timeout = 0.5, 1.0
    engine = module_procs.serve(tiny_model, "--no-enable-autotune", "--max-num-seqs", "1",
                                "--shutdown-delay", str(delay), "--shutdown-timeout", str(timeout))
    answers: dict[int, tuple[int, bytes, float]] = {}

    def plain(i: int) -> None:
        try:
            status, _, body = request(engine.port, "POST", "/v1/completions", completion_body(LONG, ignore_eos=True))
        except OSError as e:  # recorded: a request that ends without an answer fails the test by name
            status, body = -1, repr(e).encode()
        answers[i] = (status, body, time.monotonic())

    threads = [threading.Thread(target=plain, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    wait_until(lambda: held_requests(engine.port) + len(answers) == 4, 30, "the four plain completions held")
    stream = open_stream(engine.port, ignore_eos=True)
    wait_until(lambda: held_requests(engine.port) + len(answers) == 5, 30, "the stream held as well")
    t0 = time.monotonic()
    engine.proc.send_signal(signal.SIGTERM)
    events = b""
    stream.settimeout(30)
    while chunk := stream.recv(1 << 16):
        events += chunk
    for t in threads:
        t.join(30)
    assert engine.exit_code(timeout=30) == 0
    message = SHUTTING_DOWN.format(timeout=timeout)
    cut = [(status, body, at) for status, body, at in answers.values() if status == 503]
    assert cut, answers
    for status, body, at in cut:
        assert json.loads(body) == {"error": {"message": message, "type": "ServiceUnavailableError",
                                              "param": None, "code": 503}}
        assert delay + timeout - 0.3 <= at - t0 <= delay + timeout + 5, at - t0
    assert all(status in (200, 503) for status, _, _ in answers.values()), answers
    data = [line[6:] for line in events.decode().split("\n") if line.startswith("data: ")]
    assert data[-1] == "[DONE]" and json.loads(data[-2]) == {"error": {
        "message": message, "type": "ServiceUnavailableError", "param": None, "code": 503}}, data[-3:]
    log = engine.log()
    assert f"Drain deadline of {timeout:g} s passed: ending" in log and "Engine stopped" in log


def test_sigterm_under_respawn_drains_the_same_way(module_procs, tiny_model):
    engine = module_procs.serve(tiny_model, "--no-enable-autotune", "--respawn", "--shutdown-delay", "2")
    t0 = time.monotonic()
    engine.proc.send_signal(signal.SIGTERM)
    deadline = t0 + 1.0  # the supervisor passes the signal on to its serving worker
    while http("GET", f"http://127.0.0.1:{engine.port}/health")[0] != 503:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    time.sleep(max(0.0, t0 + 0.3 - time.monotonic()))
    assert complete(engine.port, "Hello", 4)["usage"]["completion_tokens"] == 4
    assert engine.exit_code(timeout=60) == 0
    # Two processes (the default): the front drains and stops its core and spare; one: the supervisor.
    stopped = "Engine stopped" if two_processes() else "Respawn supervisor stopped"
    assert stopped in engine.log() and "Drained in" in engine.log()
