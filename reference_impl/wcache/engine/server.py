"""The engine's HTTP API on the standard library's threading server.

``GET /health`` is 200 only once weights are bound; ``POST /v1/completions`` takes an OpenAI-style
body (prompt, max_tokens) and answers greedily. Bad requests get a 4xx with a JSON error and the
server keeps serving.
"""

from __future__ import annotations

import errno
import json
import logging
import signal
import sys
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from wcache.errors import ServeAddressError

log = logging.getLogger("wcache.server")

MAX_BODY_BYTES = 1 << 20
# An oversize body is read and dropped up to this much before the 413, so that an ordinary client
# still sending it sees the answer instead of a broken pipe; beyond it the connection is just cut.
MAX_DISCARD_BYTES = 16 << 20


class ApiError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


def parse_completion_request(body: bytes, max_model_len: int) -> tuple[str, int]:
    try:
        req = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ApiError(400, f"Request body is not valid JSON: {e}")
    if not isinstance(req, dict):
        raise ApiError(400, "Request body must be a JSON object")
    prompt = req.get("prompt")
    if not isinstance(prompt, str) or not prompt:
        raise ApiError(400, "'prompt' is required and must be a non-empty string")
    max_tokens = req.get("max_tokens", 16)
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int):
        raise ApiError(400, "'max_tokens' must be an integer")
    prompt_tokens = len(prompt.encode("utf-8")) + 1
    limit = max_model_len - prompt_tokens
    if not 1 <= max_tokens <= limit:
        raise ApiError(400, f"'max_tokens' must be between 1 and {max(limit, 0)} for this prompt "
                            f"(max model length {max_model_len}, prompt {prompt_tokens} tokens)")
    return prompt, max_tokens


class EngineServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address, engine, model_name: str):
        self.engine = engine
        self.model_name = model_name
        self.ready = engine is not None
        try:
            super().__init__(address, _Handler)
        except OSError as e:  # e.g. port 8000 taken: one line and status 2, not a traceback
            host, port = address[0], address[1]
            if e.errno == errno.EADDRINUSE:
                raise ServeAddressError(ServeAddressError.IN_USE.format(host=host, port=port)) from None
            raise ServeAddressError(ServeAddressError.OTHER.format(host=host, port=port, error=e.strerror or e)) from None
        # Answer from now on, while the engine loads: /health (and completions) are 503 until ready.
        self.serving = threading.Thread(target=self.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True)
        self.serving.start()

    def handle_error(self, request, client_address):
        if isinstance(sys.exc_info()[1], (BrokenPipeError, ConnectionResetError)):
            return  # the client gave up (e.g. a probe's timeout): not worth a traceback
        super().handle_error(request, client_address)


class _Handler(BaseHTTPRequestHandler):
    server: EngineServer
    protocol_version = "HTTP/1.1"

    def log_message(self, fmt, *args):  # route access logs through logging, quietly
        log.debug("%s " + fmt, self.address_string(), *args)

    def _send(self, status: int, payload: dict) -> None:
        body = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _discard(self, n: int) -> None:
        self.connection.settimeout(10)
        try:
            while n > 0:
                chunk = self.rfile.read(min(n, 1 << 16))
                if not chunk:
                    break
                n -= len(chunk)
        except OSError:
            pass

    def _error(self, status: int, message: str) -> None:
        self._send(status, {"error": {"message": message, "type": "invalid_request_error", "code": status}})

    def do_GET(self):
        if self.path == "/health":
            if self.server.ready:
                self._send(200, {"status": "ok"})
            else:
                self._send(503, {"status": "loading"})
        elif self.path == "/v1/models":
            self._send(200, {"object": "list", "data": [{"id": self.server.model_name, "object": "model"}]})
        else:
            self._error(404, f"No route for GET {self.path}")

    def do_POST(self):
        if self.path != "/v1/completions":
            self._error(404, f"No route for POST {self.path}")
            return
        try:
            length = int(self.headers.get("Content-Length", ""))
        except ValueError:
            self.close_connection = True
            self._error(411, "A Content-Length header is required")
            return
        if length > MAX_BODY_BYTES:
            self.close_connection = True  # the unread body must not be parsed as a next request
            self._discard(min(length, MAX_DISCARD_BYTES))  # so the client is not cut off mid-send
            self._error(413, f"Request body of {length} bytes exceeds the limit of {MAX_BODY_BYTES} bytes")
            return
        body = self.rfile.read(length)
        if not self.server.ready:
            self._error(503, "The engine is still loading its weights")
            return
        engine = self.server.engine
        try:
            prompt, max_tokens = parse_completion_request(body, engine.max_model_len)
        except ApiError as e:
            self._error(e.status, e.message)
            return
        text, ids, finish, n_prompt = engine.complete(prompt, max_tokens)
        self._send(200, {
            "id": f"cmpl-{uuid.uuid4().hex}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": self.server.model_name,
            "choices": [{"index": 0, "text": text, "token_ids": ids, "logprobs": None, "finish_reason": finish}],
            "usage": {"prompt_tokens": n_prompt, "completion_tokens": len(ids), "total_tokens": n_prompt + len(ids)},
        })


def run_until_signal(server: "EngineServer", on_stop=None) -> None:
    """Serve until SIGINT or SIGTERM, then close the listening socket and run ``on_stop``."""
    stop = threading.Event()

    def handle(signum, _frame):
        log.info("Received %s, shutting down", signal.Signals(signum).name)
        stop.set()

    old = {s: signal.signal(s, handle) for s in (signal.SIGINT, signal.SIGTERM)}
    thread = server.serving  # an EngineServer serves from its creation
    try:
        while not stop.wait(0.2):
            if not thread.is_alive():
                break
    finally:
        server.shutdown()
        server.server_close()
        if on_stop:
            on_stop()
        for s, h in old.items():
            signal.signal(s, h)
