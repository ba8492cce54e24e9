"""`wcache serve`'s HTTP API, over real HTTP against one engine process for the module."""

from __future__ import annotations

import json
import signal
import socket
import statistics
import time
from http.client import HTTPConnection

import pytest
from procs import complete, http
from prompt_ids import preset_encode

MAX_MODEL_LEN = 32
HELLO = len(preset_encode("Hello"))  # BOS and 3 tokens of the tiny checkpoint's tokenizer.json


@pytest.fixture(scope="module")
def engine(module_procs, tiny_model):
    return module_procs.serve(tiny_model, "--max-model-len", str(MAX_MODEL_LEN))


def url(engine, path: str) -> str:
    return f"http://127.0.0.1:{engine.port}{path}"


def assert_still_serving(engine) -> None:
    assert http("GET", url(engine, "/health"))[0] == 200
    assert complete(engine.port, "ok", 1)["usage"]["completion_tokens"] == 1


def raw_request(engine, head: bytes, body: bytes = b"") -> tuple[int, dict]:
    """Send bytes as they are (what urllib would not send) and parse the one response."""
    with socket.create_connection(("127.0.0.1", engine.port), timeout=30) as s:
        s.sendall(head + body)
        data = b""
        while b"\r\n\r\n" not in data or len(data.split(b"\r\n\r\n", 1)[1]) < _length(data):
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
    status_line, rest = data.split(b"\r\n", 1)
    return int(status_line.split()[1]), json.loads(rest.split(b"\r\n\r\n", 1)[1])


def _length(data: bytes) -> int:
    for line in data.split(b"\r\n\r\n", 1)[0].split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            return int(line.split(b":")[1])
    return 1 << 30


def test_health_and_models(engine, tiny_model):
    assert http("GET", url(engine, "/health")) == (200, {"status": "ok"})
    status, body = http("GET", url(engine, "/v1/models"))
    assert status == 200 and body["object"] == "list"
    [card] = body["data"]
    assert card["id"] == card["root"] == str(tiny_model) and card["object"] == "model" and card["owned_by"] == "wcache"
    assert card["max_model_len"] == MAX_MODEL_LEN and isinstance(card["created"], int)
    assert "Loaded 27 tensors" in engine.log() and "from disk in" in engine.log()
    assert "Loading safetensors checkpoint shards" in engine.log()  # the progress bar over shards


def test_completion_is_openai_shaped_and_greedy(engine, tiny_model):
    body = complete(engine.port, "Hello", 8)
    assert body["id"].startswith("cmpl-") and body["object"] == "text_completion"
    assert isinstance(body["created"], int) and body["model"] == str(tiny_model)
    [choice] = body["choices"]
    assert set(choice) == {"index", "text", "token_ids", "logprobs", "finish_reason", "stop_reason"}
    assert choice["index"] == 0 and choice["logprobs"] is None and isinstance(choice["text"], str)
    assert choice["finish_reason"] in ("length", "stop")
    n = len(choice["token_ids"])
    assert n == 8 if choice["finish_reason"] == "length" else 1 <= n <= 8
    assert body["usage"] == {"prompt_tokens": HELLO, "completion_tokens": n, "total_tokens": HELLO + n}
    again = complete(engine.port, "Hello", 8)
    assert again["choices"][0]["token_ids"] == choice["token_ids"] and again["id"] != body["id"]


def test_streamed_answers_on_a_keep_alive_connection_are_not_held_for_the_clients_ack(engine):
    # A stream is many small writes; with Nagle's algorithm each one after the first waited for the
    # client's delayed ACK (about 40 ms on Linux): a streamed max_tokens=1 completion took 48 ms
    # instead of 6 on a reused connection, as the official OpenAI client's pool reuses them.
    conn = HTTPConnection("127.0.0.1", engine.port, timeout=30)
    body = json.dumps({"prompt": "Hello", "max_tokens": 1, "stream": True})
    times = []
    for _ in range(15):
        t0 = time.perf_counter()
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        r = conn.getresponse()
        assert r.status == 200 and r.read().rstrip().endswith(b"data: [DONE]")
        times.append(time.perf_counter() - t0)
    conn.close()
    assert statistics.median(times) < 0.03, times

def test_prompt_tokens_are_the_checkpoint_tokenizers(engine):
    assert complete(engine.port, "héllo", 1)["usage"]["prompt_tokens"] == len(preset_encode("héllo")) == 5


def test_max_tokens_up_to_the_model_length_is_served(engine):
    body = complete(engine.port, "Hello", MAX_MODEL_LEN - 6)
    assert body["usage"]["total_tokens"] <= MAX_MODEL_LEN


RANGE = f"'max_tokens' must be between 1 and {MAX_MODEL_LEN - HELLO} for this prompt (max model length 32, prompt {HELLO} tokens)"
BAD_REQUESTS = {
    "malformed_json": (b'{"prompt": "Hello",', "Request body is not valid JSON: "),
    "not_utf8": (b'\xff\xfe{"prompt": 1}', "Request body is not valid JSON: "),
    "not_an_object": (b'["Hello"]', "Request body must be a JSON object"),
    "missing_prompt": ({"max_tokens": 4}, "'prompt' is required and must be a non-empty string"),
    "empty_prompt": ({"prompt": ""}, "'prompt' is required and must be a non-empty string"),
    "prompt_not_text_or_ids": ({"prompt": [1.5]}, "'prompt' is required and must be a non-empty string"),
    "prompt_mixed_list": ({"prompt": [[1], 2]}, "'prompt' is required and must be a non-empty string"),
    "max_tokens_string": ({"prompt": "Hello", "max_tokens": "4"}, "'max_tokens' must be an integer"),
    "max_tokens_float": ({"prompt": "Hello", "max_tokens": 4.0}, "'max_tokens' must be an integer"),
    "max_tokens_bool": ({"prompt": "Hello", "max_tokens": True}, "'max_tokens' must be an integer"),
    "max_tokens_zero": ({"prompt": "Hello", "max_tokens": 0}, RANGE),
    "max_tokens_negative": ({"prompt": "Hello", "max_tokens": -3}, RANGE),
    "max_tokens_past_the_model_length": ({"prompt": "Hello", "max_tokens": MAX_MODEL_LEN - HELLO + 1}, RANGE),
}


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_bad_requests_get_400_with_their_message(engine, case):
    body, message = BAD_REQUESTS[case]
    status, answer = http("POST", url(engine, "/v1/completions"), body)
    assert status == 400, answer
    assert answer["error"]["message"].startswith(message)
    assert answer["error"]["code"] == 400 and answer["error"]["type"] == "BadRequestError"  # vLLM's shape
    assert_still_serving(engine)


def test_oversize_body_gets_413_without_being_read(engine):
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 1048577\r\n\r\n")
    status, answer = raw_request(engine, head, b"x" * 65536)  # the server answers before the rest arrives
    assert status == 413
    assert answer["error"]["message"] == "Request body of 1048577 bytes exceeds the limit of 1048576 bytes"
    assert_still_serving(engine)


def test_full_oversize_body_from_a_client_gets_413(engine):
    status, answer = http("POST", url(engine, "/v1/completions"),
                          json.dumps({"prompt": "x" * (1 << 20)}).encode())
    assert status == 413 and "exceeds the limit of 1048576 bytes" in answer["error"]["message"]
    assert_still_serving(engine)


def test_missing_content_length_gets_411(engine):
    status, answer = raw_request(engine, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n\r\n")
    assert status == 411 and answer["error"]["message"] == "A Content-Length header is required"
    assert_still_serving(engine)


@pytest.mark.parametrize("method,path", [("GET", "/nope"), ("POST", "/v1/embeddings"), ("GET", "/v1/completions")])
def test_unknown_routes_get_404(engine, method, path):
    status, answer = http(method, url(engine, path), {"prompt": "x"} if method == "POST" else None)
    assert status == 404 and answer["error"]["message"] == f"No route for {method} {path}"
    assert_still_serving(engine)


def test_an_http_1_0_client_gets_its_stream_unchunked_until_the_close(engine):
    body = json.dumps({"prompt": "Hello", "max_tokens": 4, "stream": True}).encode()
    with socket.create_connection(("127.0.0.1", engine.port), timeout=30) as s:
        s.sendall(b"POST /v1/completions HTTP/1.0\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    head, _, events = data.partition(b"\r\n\r\n")
    assert b"text/event-stream" in head and b"Transfer-Encoding" not in head
    lines = [e for e in events.split(b"\n\n") if e]
    assert all(e.startswith(b"data: ") for e in lines) and lines[-1] == b"data: [DONE]"
    text = "".join(json.loads(e[6:])["choices"][0]["text"] for e in lines[:-1])
    assert text == complete(engine.port, "Hello", 4)["choices"][0]["text"]


def test_sigterm_stops_serve_with_exit_0(engine):
    """Runs last in this module: it stops the module's engine."""
    assert engine.stop(signal.SIGTERM) == 0
    log = engine.log()
    assert "Received SIGTERM, shutting down" in log and "Engine stopped" in log
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", engine.port), timeout=2).close()

