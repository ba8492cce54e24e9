"""The engine's HTTP API on the standard library's threading server.

``GET /health`` is 200 only once weights are bound; ``POST /v1/completions`` takes an OpenAI-style
body (prompt, max_tokens) and answers greedily. Bad requests get a 4xx with a JSON error and the
server keeps serving: a body is read only with a valid, bounded Content-Length and within
BODY_DEADLINE_S in all; every read waits at most READ_TIMEOUT_S; at most MAX_CONNECTIONS are
served at once (the next one gets a 503 at once); any JSON the parser refuses (a lone surrogate,
nesting past the stack, an integer past the digit limit) is a 400, and so is every request the
standard library itself rejects (its HTML error pages are JSON here).
"""

from __future__ import annotations

import errno
import json
import logging
import re
import signal
import socket
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
READ_TIMEOUT_S = 10.0  # each read of a request line, header or body chunk
BODY_DEADLINE_S = 30.0  # the whole body
MAX_CONNECTIONS = 64  # connections served at once (each is a thread)
_LENGTH = re.compile(r"[0-9]{1,12}")  # no sign, no spaces, no 5000-digit numbers


class ApiError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


def parse_completion_request(body: bytes, max_model_len: int) -> tuple[str, int]:
    try:
        req = json.loads(body)
    except (ValueError, RecursionError) as e:  # bad UTF-8 or JSON, an int past the digit limit, deep nesting
        raise ApiError(400, f"Request body is not valid JSON: {str(e)[:200] or type(e).__name__}")
    if not isinstance(req, dict):
        raise ApiError(400, "Request body must be a JSON object")
    prompt = req.get("prompt")
    if not isinstance(prompt, str) or not prompt:
        raise ApiError(400, "'prompt' is required and must be a non-empty string")
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError:  # "\ud800" is valid JSON but no text
        raise ApiError(400, "'prompt' contains a lone surrogate: it is not valid Unicode text") from None
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
    request_queue_size = 128  # a burst waits in the backlog, not in SYN retries; past MAX_CONNECTIONS it gets a 503

    def __init__(self, address, engine, model_name: str, sock: socket.socket | None = None):
        """``sock``: serve on this listening socket instead of binding ``address`` (``wcache serve
        --respawn``: its supervisor bound it, keeps it open across workers, engine/respawn.py)."""
        self.engine = engine
        self.model_name = model_name
        self.ready = engine is not None
        try:
            super().__init__(address, _Handler, bind_and_activate=sock is None)
        except OSError as e:  # e.g. port 8000 taken: one line and status 2, not a traceback
            raise address_error(e, address) from None
        if sock is not None:
            self.socket.close()
            self.socket, self.server_address = sock, sock.getsockname()
        self.slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        # Answer from now on, while the engine loads: /health (and completions) are 503 until ready.
        self.serving = threading.Thread(target=self.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True)
        self.serving.start()

    def process_request(self, request, client_address):
        """A thread per connection, at most MAX_CONNECTIONS: past that, a 503 at once and a close."""
        if not self.slots.acquire(blocking=False):
            try:
                request.settimeout(1.0)
                body = json.dumps({"error": {"message": BUSY_MESSAGE.format(max=MAX_CONNECTIONS),
                                             "type": "server_busy", "code": 503}}).encode()
                request.sendall(b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                                b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
            except OSError:
                pass
            self.shutdown_request(request)
            return
        super().process_request(request, client_address)

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.slots.release()

    def handle_error(self, request, client_address):
        if isinstance(sys.exc_info()[1], (BrokenPipeError, ConnectionResetError)):
            return  # the client gave up (e.g. a probe's timeout): not worth a traceback
        super().handle_error(request, client_address)


BUSY_MESSAGE = "The server is handling {max} connections; retry shortly"


def address_error(e: OSError, address) -> ServeAddressError:
    host, port = address[0], address[1]
    if e.errno == errno.EADDRINUSE:
        return ServeAddressError(ServeAddressError.IN_USE.format(host=host, port=port))
    return ServeAddressError(ServeAddressError.OTHER.format(host=host, port=port, error=e.strerror or e))


class _Handler(BaseHTTPRequestHandler):
    server: EngineServer
    protocol_version = "HTTP/1.1"
    timeout = READ_TIMEOUT_S  # StreamRequestHandler sets it on the socket: no read waits longer

    def send_error(self, code, message=None, explain=None):
        """The standard library's own refusals (bad request line, headers too long, a read that
        timed out) as the same JSON errors as ours, and the connection closed."""
        self.close_connection = True
        if getattr(self, "request_version", "HTTP/0.9") == "HTTP/0.9":
            self.request_version = "HTTP/1.0"  # an unparsable request line still gets a status line
        try:
            self._error(code, message or self.responses.get(code, ("Error",))[0])
        except OSError:
            pass

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

    def _read_body(self, length: int) -> bytes | None:
        """The body, or None when it is not complete within BODY_DEADLINE_S (or the peer closed)."""
        deadline = time.monotonic() + BODY_DEADLINE_S
        parts, got = [], 0
        try:
            while got < length:
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self.connection.settimeout(min(left, READ_TIMEOUT_S))
                chunk = self.rfile.read1(min(length - got, 1 << 16))
                if not chunk:
                    return None
                parts.append(chunk)
                got += len(chunk)
        except (TimeoutError, OSError):
            return None
        finally:
            try:
                self.connection.settimeout(READ_TIMEOUT_S)
            except OSError:
                pass
        return b"".join(parts)

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
        raw = self.headers.get("Content-Length")
        if raw is None:
            self.close_connection = True
            self._error(411, "A Content-Length header is required")
            return
        if not _LENGTH.fullmatch(raw.strip()):  # int() would take "-1", "+5", "1_000" and 5000 digits
            self.close_connection = True
            self._error(400, f"Content-Length must be a number of bytes, got {raw[:32]!r}")
            return
        length = int(raw)
        if length > MAX_BODY_BYTES:
            self.close_connection = True  # the unread body must not be parsed as a next request
            self._discard(min(length, MAX_DISCARD_BYTES))  # so the client is not cut off mid-send
            self._error(413, f"Request body of {length} bytes exceeds the limit of {MAX_BODY_BYTES} bytes")
            return
        body = self._read_body(length)
        if body is None:
            self.close_connection = True
            self._error(408, f"The request body did not arrive within {BODY_DEADLINE_S:.0f}s")
            return
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


def run_until_signal(server: EngineServer, on_stop=None) -> None:
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
