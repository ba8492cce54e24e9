"""Two answers the attack round found missing (issue sec-3): a busy 503 without ``Retry-After``, and
no answer at all for a client that half-closes its connection after sending its request.

Real sockets against a real `wcache serve`: the half-closing client is a raw socket that calls
``shutdown(SHUT_WR)``; it must get the interim ``100 Continue`` the engine writes to tell a
half-close from a close (engine/api_server/client_gone.py), then its 200. A client that closes outright is
still seen gone (tests/integration/test_front_door_ops.py's abandoned completions).
"""

from __future__ import annotations

import json
import socket

import pytest
from test_front_door_ops import LIMIT, completion_body, open_stream, post_head, request
from wcache.errors import BUSY_MESSAGE

INTERIM = b"HTTP/1.1 100 Continue\r\n\r\n"  # engine/api_server/client_gone.py writes it at a FIN


@pytest.fixture(scope="module")
def engine(module_procs, tiny_model):
    return module_procs.serve(tiny_model, "--no-enable-autotune", "--max-concurrent-connections", str(LIMIT))


def read_all(s: socket.socket) -> bytes:
    data = b""
    while chunk := s.recv(1 << 16):
        data += chunk
    return data


def test_a_client_that_half_closes_after_its_request_gets_its_answer(engine):
    body = completion_body(24)
    with socket.create_connection(("127.0.0.1", engine.port), timeout=60) as s:
        s.sendall(post_head(body).replace(b"Host: x\r\n", b"Host: x\r\nConnection: close\r\n") + body)
        s.shutdown(socket.SHUT_WR)  # nothing more to send; the answer is still wanted
        answer = read_all(s)
    assert answer.startswith(INTERIM + b"HTTP/1.1 200 "), answer[:200]
    completion = json.loads(answer.split(b"\r\n\r\n", 2)[2])
    assert completion["usage"]["completion_tokens"] == 24, completion


def test_an_http_1_0_client_that_half_closes_is_taken_as_gone(engine):
    """A 1xx cannot be sent to an HTTP/1.0 client, so its FIN still ends the request (nothing written)."""
    body = completion_body(400)
    with socket.create_connection(("127.0.0.1", engine.port), timeout=60) as s:
        s.sendall(post_head(body).replace(b"HTTP/1.1", b"HTTP/1.0") + body)
        s.shutdown(socket.SHUT_WR)
        assert read_all(s) == b""


def test_the_busy_503_says_when_to_retry(engine):
    held = [open_stream(engine.port) for _ in range(LIMIT)]
    try:
        for s in held:
            assert s.recv(1 << 16).startswith(b"HTTP/1.1 200 ")
        status, headers, body = request(engine.port, "POST", "/v1/completions", completion_body(1))
        assert status == 503 and json.loads(body)["error"]["message"] == BUSY_MESSAGE.format(max=LIMIT)
        assert headers["Retry-After"] == "1", headers
    finally:
        for s in held:
            s.close()
