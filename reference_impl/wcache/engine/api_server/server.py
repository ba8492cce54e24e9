"""The engine's HTTP API: routes, on the front door of http_front.py, answering as openai_api.py says.

| Route | Answer |
| --- | --- |
| ``GET /health``, ``HEAD /health`` | 200 once weights are bound, 503 while they load or drain |
| ``GET /version``, ``GET /metrics`` | what runs; Prometheus metrics (the health lane, with /health) |
| ``GET /v1/models`` | the served names, in vLLM's shape |
| ``GET /v1/models/{id}`` | one served name's card, or a 404 |
| ``POST /v1/completions`` | a completion, or with ``"stream": true`` server-sent events |
| ``POST /v1/chat/completions`` | a chat completion (chat.py), streamed or not |

With an API key (auth.py), every ``/v1/`` route first answers 401 to a request without it.

A body is read only with a valid, bounded Content-Length and under the request's deadline; any
JSON the parser refuses (a lone surrogate, nesting past the stack, an integer past the digit limit)
is a 400, and so is every request the standard library itself rejects (as JSON). ``EngineServer``
serves from its creation (``/health`` is 503 until ``engine`` is set and ``ready``), on the address
it binds or on a listening socket it is handed (``sock=``).
"""

from __future__ import annotations

import functools
import json
import logging
import re
import signal
import threading
import time
from urllib.parse import unquote

from wcache.core.stop_flag import StopFlag
from wcache.engine.openai import chat, fanout
from wcache.engine.api_server import http_front
from wcache.engine.openai import openai_api as api
from wcache.engine.loading import waiting
from wcache.engine.api_server.served import ServedModel
from wcache.engine.api_server.settings import HttpSettings
from wcache.engine.api_server.access_log import CLIENT_CLOSED
from wcache.engine.api_server.client_gone import PeerWatch
from wcache.engine.api_server.drain import SHUTDOWN_DELAY_S, SHUTDOWN_TIMEOUT_S, drain
from wcache.engine.core.scheduler import QueueFull
from wcache.engine.api_server.version_info import version_body
from wcache import errors
from wcache.errors import (API_KEY_MISSING, API_KEY_WRONG, BAD_LENGTH, LANE_BUSY, LOADING, NO_LENGTH, NO_METRICS,
                           NO_ROUTE, NOT_ALLOWED, QUEUE_FULL, SHUTTING_DOWN, TOO_LARGE)
from wcache.engine.api_server.http_front import BUSY_MESSAGE, DEFAULT_LIMITS, FrontDoorHandler, FrontDoorServer, Limits
from wcache.engine.api_server.metrics import EngineMetrics

log = logging.getLogger("wcache.server")

MAX_BODY_BYTES = 1 << 20
# An oversize body is read and dropped up to this much before the 413, so that an ordinary client
# still sending it sees the answer instead of a broken pipe; beyond it the connection is just cut.
MAX_DISCARD_BYTES = 16 << 20
READ_TIMEOUT_S = DEFAULT_LIMITS.read_timeout_s  # each read of a request
BODY_DEADLINE_S = REQUEST_DEADLINE_S = DEFAULT_LIMITS.request_deadline_s  # the whole request from its first byte
MAX_CONNECTIONS = DEFAULT_LIMITS.max_connections  # connections served at once (each is a thread)
RETRY_AFTER_S = 1  # a full waiting queue's Retry-After: a slot frees as soon as any running request ends
_LENGTH = re.compile(r"[0-9]{1,12}")  # no sign, no spaces, no 5000-digit numbers

# Every route, with what it answers (docs/serve-reference.md's endpoint table is generated from it).
ROUTES = {
    ("GET", "/health"): '503 `{"status": "loading"}` while the weights load, then 200 `{"status": "ok"}`; 503 '
                        '`{"status": "waiting_for_weight_cache", "socket", "reason", "timeout_s", "waited_s"}` while '
                        'an ipc_cache engine with `"fallback": false` waits for its daemon; 503 '
                        '`{"status": "draining"}` from a SIGTERM on; answered apart from completions (the health lane)',
    ("HEAD", "/health"): "the same status and headers as `GET /health`, without the body",
    ("GET", "/version"): '`{"version", "commit", "torch", "device"}`: wcache\'s version, the git commit when run '
                         'from a checkout (else `null`), torch\'s version, the device (`null` while loading)',
    ("GET", "/metrics"): "Prometheus metrics, in the text exposition format ([Monitoring](monitoring.md))",
    ("GET", "/v1/models"): "a card per served name (`--served-model-name`, default the model directory as given) "
                           "in vLLM's shape: `id`, `object`, `created`, `owned_by` (`wcache`), `root` (the model "
                           "directory), `parent`, `max_model_len`",
    ("GET", "/v1/models/{id}"): "the card of one served name (URL-encoded), or a 404",
    ("POST", "/v1/completions"): "a completion in vLLM's shape, a choice per prompt (each adds `token_ids` and "
                                 "`stop_reason`); with `\"stream\": true`, server-sent events",
    ("POST", "/v1/chat/completions"): "a chat completion in vLLM's shape (`chat.completion`, `choices[0].message`); "
                                      "with `\"stream\": true`, server-sent `chat.completion.chunk` events",
}
# Every refusal the routes and the front door give: (status, message, when); the type is the status's.
REFUSALS = [
    (400, api.UNKNOWN_FIELD, "a field the table above does not list"),
    (400, api.REFUSED_FIELD, "a refused field with anything but its neutral value"),
    (404, api.MODEL_NOT_FOUND, "`model` (or `GET /v1/models/{id}`) is not a served name"),
    (400, api.NO_CHAT_TEMPLATE, "a `POST /v1/chat/completions` when the engine has no chat template"),
    (400, api.CHAT_TEMPLATE_RENDER, "the template refused the messages (its `raise_exception`) or failed on them"),
    (400, api.PROMPT_TOO_LONG, "a chat prompt that leaves no room for one token"),
    (400, api.TOKEN_OUT_OF_VOCAB, "a prompt of token ids with one past the model's vocabulary"),
    (400, api.PROMPT_LIST_TOO_LONG, f"more than {api.MAX_PROMPTS} prompts in one request"),
    # vLLM's sampling and scoring parameters (engine/openai/sampling_fields.py), vLLM's texts
    (400, errors.N_RANGE, "`n` below 1"),
    (400, errors.N_TOO_MANY, f"`n` times the prompts is over {api.MAX_PROMPTS} choices"),
    (400, errors.LOGPROBS_TOO_MANY, "`logprobs` (chat: `top_logprobs`) over 20, vLLM's --max-logprobs default"),
    (400, errors.LOGPROBS_NEGATIVE, "a negative `logprobs`"),
    (400, errors.TOP_LOGPROBS_WITHOUT_LOGPROBS, "chat's `top_logprobs` without `\"logprobs\": true`"),
    (400, errors.TOP_LOGPROBS_NEGATIVE, "a `top_logprobs` below 0 (but -1: the whole vocabulary, over 20)"),
    (400, errors.PROMPT_LOGPROBS_TOO_MANY, "`prompt_logprobs` over 20"),
    (400, errors.PROMPT_LOGPROBS_STREAM, "`prompt_logprobs` with `\"stream\": true`"),
    (400, errors.PRESENCE_PENALTY, "`presence_penalty` outside [-2, 2]"),
    (400, errors.FREQUENCY_PENALTY, "`frequency_penalty` outside [-2, 2]"),
    (400, errors.REPETITION_PENALTY, "`repetition_penalty` 0 or below"),
    (400, errors.TOP_K, "`top_k` below -1"),
    (400, errors.MIN_P, "`min_p` outside [0, 1]"),
    (400, errors.MIN_TOKENS, "a negative `min_tokens`"),
    (400, errors.MIN_TOKENS_OVER_MAX, "`min_tokens` over `max_tokens`"),
    (400, errors.LOGIT_BIAS_KEY, "a `logit_bias` key that is not a token id"),
    (400, errors.LOGIT_BIAS_VOCAB, "a `logit_bias` token id past the vocabulary"),
    (400, errors.NUMBER_FIELD, "a sampling field that takes a number given something else"),
    (400, errors.INTEGER_FIELD, "a field that takes an integer (`n`, `top_k`, `min_tokens`, the logprobs counts) "
                                "given something else"),
    (401, API_KEY_MISSING, "with an API key set: a `/v1/` request without `Authorization: Bearer`"),
    (401, API_KEY_WRONG, "with an API key set: a `/v1/` request with another key"),
    (400, api.NOT_JSON, "the body is not JSON (bad UTF-8, a lone surrogate, nesting too deep)"),
    (400, http_front.BOTH_FRAMINGS, "`Transfer-Encoding` and `Content-Length` together"),
    (400, http_front.MANY_LENGTHS, "two `Content-Length` headers, or a list of lengths"),
    (400, BAD_LENGTH, "a length with a sign, spaces or more than 12 digits"),
    (411, NO_LENGTH, "a POST without `Content-Length` (chunked bodies are not read)"),
    (413, TOO_LARGE, "a body over 1 MiB"),
    (408, http_front.TIMED_OUT, "the request line, headers and body did not all arrive in time"),
    (503, BUSY_MESSAGE, "`--max-concurrent-connections` requests are being answered, or every waiting slot is "
                        "taken by connections sending their request for less than a second"),
    (503, LANE_BUSY, "as many health, metrics and version requests are being answered as the lane allows"),
    (405, NOT_ALLOWED, "a method other than GET or HEAD on `/health`, `/metrics` or `/version`"),
    (503, SHUTTING_DOWN, "a completion still running at the drain's deadline (a stream gets it as an SSE "
                         "`error` event, then `[DONE]`)"),
    (503, LOADING, "a request before the weights are loaded"),
    (503, QUEUE_FULL, "`--max-waiting-requests` requests already wait for a batch slot; the answer carries "
                      "`Retry-After: 1`"),
    (404, NO_ROUTE, "any other method or path"),
]

__all__ = ["EngineServer", "run_until_signal", "BUSY_MESSAGE", "Limits"]

# ``GET /metrics``'s body: a function returning (bytes, content type), set by the metrics module
# (e.g. ``server.render_metrics = registry_renderer``); None answers 404 NO_METRICS.
MetricsRenderer = "Callable[[], tuple[bytes, str]]"


class EngineServer(FrontDoorServer):
    def __init__(self, address, engine, model_name: str | ServedModel, limits: Limits = DEFAULT_LIMITS, sock=None):
        self.engine = engine
        self.served = ServedModel.of(model_name)  # names, chat template, API keys
        self.model_name = self.served.name
        self.ready = engine is not None
        self.created = int(time.time())
        self.metrics = EngineMetrics(self)  # GET /metrics (engine/api_server/metrics.py), read by the health lane
        self.draining = False  # a SIGTERM came: /health is 503 from then on (engine/api_server/drain.py)
        self.aborting = threading.Event()  # the drain's deadline passed: running completions end with an error
        self.render_metrics = None  # MetricsRenderer, or None (404)
        self.shutdown_delay, self.shutdown_timeout = SHUTDOWN_DELAY_S, SHUTDOWN_TIMEOUT_S
        super().__init__(address, _Handler, limits, sock)
        # Answer from now on, while the engine loads: /health (and completions) are 503 until ready.
        self.serving = threading.Thread(target=self.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True)
        self.serving.start()


    @classmethod
    def from_settings(cls, http: HttpSettings, served: ServedModel, engine, sock=None) -> EngineServer:
        """The server ``wcache serve``'s HTTP settings describe; ``served``: what
        ServedModel.from_settings read once, before the weights loaded."""
        limits = Limits(max_connections=http.max_concurrent_connections)
        server = cls((http.host, http.port), engine, served, limits=limits, sock=sock)
        server.log_requests = not http.disable_log_requests
        server.shutdown_delay = http.shutdown_delay
        server.shutdown_timeout = http.shutdown_timeout
        return server


class _Handler(FrontDoorHandler):
    server: EngineServer

    def _error(self, status: int, message: str, param: str | None = None) -> None:
        self.send_json(status, api.error_body(status, message, param))

    def answer_lane(self):
        """GET or HEAD of /health, /version, /metrics (http_front.py routes them here, on their own budget)."""
        server = self.server
        if self.path == "/health":
            if server.draining:
                self.send_json(503, {"status": "draining"})
            elif server.ready and getattr(server.engine, "failure", None) is not None:
                self.send_json(503, {"status": "engine failed"})
            elif server.ready:
                self.send_json(200, {"status": "ok"})
            else:  # with "fallback": false, the loader may be waiting for the daemon (loading/waiting.py)
                self.send_json(503, waiting.health_body() or {"status": "loading"})
        elif self.path == "/version":
            engine = server.engine if server.ready else None
            self.send_json(200, version_body(engine.cfg.device if engine is not None else None))
        else:
            # The hook, or the metrics module's EngineMetrics (server.metrics) once it is merged in.
            render = server.render_metrics or getattr(getattr(server, "metrics", None), "render_metrics", None)
            if render is None:
                self._error(404, NO_METRICS)
                return
            body, content_type = render()
            self.send_bytes(200, body, content_type)

    def _unauthorized(self) -> bool:
        """A 401 (the body, if any, unread) for a /v1/ request without the API key; never logs a key."""
        why = self.server.served.api_keys.refusal(self.path.split("?", 1)[0], self.headers.get("Authorization"))
        if why is None:
            return False
        self.close_connection = True
        self.begin_answer()
        self._error(401, why)
        return True

    def do_GET(self):
        if self._unauthorized():
            return
        self.begin_answer()
        served, path = self.server.served, self.path.split("?", 1)[0]
        engine = self.server.engine if self.server.ready else None
        max_model_len = engine.max_model_len if engine is not None else None
        if path == "/v1/models":
            self.send_json(200, api.models_body(served.names, self.server.created, max_model_len, served.root))
        elif path.startswith("/v1/models/"):
            name = unquote(path[len("/v1/models/"):])
            if name in served.names:
                self.send_json(200, api.model_card(name, served.root, self.server.created, max_model_len))
            else:
                self._error(404, api.MODEL_NOT_FOUND.format(model=name[:256]), "model")
        else:
            self._error(404, NO_ROUTE.format(method="GET", path=self.path[:200]))

    def _body(self) -> bytes | None:
        """The request's body, or None once the answer (a 4xx) is sent or the peer is gone."""
        raw = self.headers.get("Content-Length")
        if raw is None:
            self.close_connection = True
            self._error(411, NO_LENGTH)
            return None
        if not _LENGTH.fullmatch(raw.strip()):  # int() would take "-1", "+5", "1_000" and 5000 digits
            self.close_connection = True
            self._error(400, BAD_LENGTH.format(value=raw[:32]))
            return None
        length = int(raw)
        if length > MAX_BODY_BYTES:
            self.close_connection = True  # the unread body must not be parsed as a next request
            self._discard(min(length, MAX_DISCARD_BYTES))  # so the client is not cut off mid-send
            self._error(413, TOO_LARGE.format(length=length, max=MAX_BODY_BYTES))
            return None
        body = self.read_body(length)
        if len(body) < length:  # the peer closed before sending it all: nobody to answer
            self.close_connection = True
            return None
        return body

    def _discard(self, n: int) -> None:
        try:
            while n > 0:
                chunk = self.rfile.read1(min(n, 1 << 16))
                if not chunk:
                    break
                n -= len(chunk)
        except OSError:
            pass

    def do_POST(self):
        if self._unauthorized():
            return
        if ("POST", self.path) not in ROUTES:
            self.close_connection = True  # its body is not read
            self.begin_answer()
            self._error(404, NO_ROUTE.format(method="POST", path=self.path[:200]))
            return
        body = self._body()
        self.begin_answer()
        if body is None:
            return
        if not self.server.ready:
            self._error(503, LOADING)
            return
        engine, served = self.server.engine, self.server.served
        is_chat = self.path == "/v1/chat/completions"
        try:
            if is_chat:
                req = chat.parse_chat_request(body, served.chat_template, engine.max_model_len, served.names,
                                              engine.has_draft, engine.tokenizer, engine.cfg.hf.get("vocab_size"))
            else:
                req = api.parse_completion_request(body, engine.max_model_len, served.names, engine.has_draft,
                                                   engine.cfg.hf.get("vocab_size"), engine.tokenizer)
            prompts = req.choice_prompts()  # one sequence per choice: each prompt n times
        except api.ApiError as e:
            self.send_json(e.status, e.body())
            return
        record, aborting = self.record, self.server.aborting
        if aborting.is_set():
            self._error(503, SHUTTING_DOWN.format(timeout=self.server.shutdown_timeout))
            return
        queued = functools.partial(self.server.connections.handed, self.connection)  # no longer arriving
        with self.server.metrics.request() as timing:
            if req.stream:
                events = (chat.ChatStream if is_chat else api.CompletionStream)(served.name, req.include_usage, req,
                                                                                 engine.tokenizer)
                self._stream(engine, prompts, req, events, timing, queued)
                return
            gone = cut = False

            peer = PeerWatch(self.connection, self.request_version == "HTTP/1.1")

            def on_text(_piece: str) -> bool:
                # Asked at each new piece of text (of any prompt of the request): the client left
                # (nobody to answer), or the drain's deadline passed. Either stops decoding at this token.
                nonlocal gone, cut
                record.token()
                timing.first_token()
                gone = gone or peer.gone()
                cut = cut or aborting.is_set()
                return gone or cut

            try:
                done = fanout.run_all(engine, prompts, req, on_text, queued)
            except QueueFull as e:
                self._queue_full(e)
                return
            except RuntimeError as e:  # the engine failed: a lost rank, an engine core that died
                log.error("A completion failed: %s", e)
                self.close_connection = True
                self._error(500, str(e)[:200])
                return
            for c in done:
                timing.finish(c, "abort" if gone or cut else None)
        record.prompt_tokens = sum(c.prompt_tokens for c in done[::req.n])
        record.generation_tokens = sum(len(c.token_ids) for c in done)
        if gone:
            self.close_connection = True
            record.status = CLIENT_CLOSED
            return
        if cut:
            self.close_connection = True
            self._error(503, SHUTTING_DOWN.format(timeout=self.server.shutdown_timeout))
            return
        self.send_json(200, chat.chat_body(chat.new_id(), served.name, done, req, engine.tokenizer) if is_chat
                       else api.completion_body(api.new_id(), served.name, done, req, engine.tokenizer))

    def _queue_full(self, e: QueueFull) -> None:
        """503 with Retry-After: the engine's waiting queue is full (--max-waiting-requests)."""
        body = json.dumps(api.error_body(503, QUEUE_FULL.format(waiting=e.waiting, max=e.limit))).encode()
        self.send_response(503)
        self.send_header("Content-Type", "application/json")
        self.send_header("Retry-After", str(RETRY_AFTER_S))
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _stream(self, engine, prompts: list, req, events, timing, queued) -> None:
        """Server-sent events, as vLLM sends them (``events`` says which: openai_api.CompletionStream,
        chat.ChatStream). The engine decodes on other threads (fanout.py) and this thread writes the
        events as the engine loop hands it tokens (the loop itself never waits for a client); a
        client that goes away stops the decoding at its next token, and so does the drain's
        deadline, which ends the stream with an ``error`` event and ``[DONE]``. The 200 goes out
        with the first event, so a full waiting queue can still be a 503."""
        gone = threading.Event()
        record, aborting = self.record, self.server.aborting
        started = False

        def start() -> None:
            nonlocal started
            started = True
            self.chunked = self.request_version == "HTTP/1.1"  # an HTTP/1.0 client reads to the close instead
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream; charset=utf-8")
            self.send_header("Cache-Control", "no-cache")
            if self.chunked:
                self.send_header("Transfer-Encoding", "chunked")
            else:
                self.close_connection = True
                self.send_header("Connection", "close")
            self.end_headers()
            for payload in events.first():
                self._event(payload, gone)

        def stop() -> bool:
            record.token()
            timing.first_token()
            return gone.is_set() or aborting.is_set()

        done: list = [None] * len(prompts)
        for kind, i, item in fanout.stream(engine, prompts, req, stop, self.server.threads.submit, queued):
            if kind == "error":
                if isinstance(item, QueueFull) and not started:
                    self._queue_full(item)
                    return
                self.close_connection = True
                log.error("A streamed completion failed: %s", item)
                if not started:
                    self._error(500, str(item)[:200])
                else:  # the client hears why its stream ends, as a drain's deadline says it
                    self._event(api.error_body(500, str(item)[:200]), gone)
                    self._event(api.DONE, gone)
                    if self.chunked and not gone.is_set():
                        try:
                            self.wfile.write(b"0\r\n\r\n")
                        except OSError:
                            pass
                return
            if not started:
                start()
            if kind == "done":
                done[i] = item
                timing.finish(item, "abort" if gone.is_set() or aborting.is_set() else None)
                if aborting.is_set():
                    continue  # the stream ends with the drain's error below
            for payload in (events.text(i, item) if kind == "text" else events.done(i, item)):
                self._event(payload, gone)
        if not started:
            start()
        record.prompt_tokens = sum(c.prompt_tokens for c in done[::req.n])
        record.generation_tokens = sum(len(c.token_ids) for c in done)
        if aborting.is_set() and not gone.is_set():  # cut at the drain's deadline: say so, then end
            self.close_connection = True
            self._event(api.error_body(503, SHUTTING_DOWN.format(timeout=self.server.shutdown_timeout)), gone)
            self._event(api.DONE, gone)
        else:
            for payload in events.last(done):
                self._event(payload, gone)
        if not gone.is_set() and self.chunked:
            try:
                self.wfile.write(b"0\r\n\r\n")
            except OSError:
                gone.set()
        if gone.is_set():
            self.close_connection = True
            record.status = CLIENT_CLOSED

    def _event(self, payload, gone: threading.Event) -> None:
        if gone.is_set():
            return
        data = api.sse(payload)
        try:
            self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data) if self.chunked else data)  # a chunk per event
        except OSError:
            gone.set()


def run_until_signal(server: EngineServer, on_stop=None) -> None:
    """Serve until SIGTERM or SIGINT, then drain (engine/api_server/drain.py), close the listening socket and
    run ``on_stop``. SIGTERM (Kubernetes, docker stop) keeps accepting for ``shutdown_delay`` first;
    SIGINT (Ctrl-C at a terminal, where no load balancer routes) and a second signal skip the rest
    of that delay; the in-flight requests still get their ``shutdown_timeout``."""
    stop, again = StopFlag(), StopFlag()  # set in the handler: no lock (core/stop_flag.py)
    first: list[int] = []

    def handle(signum, _frame):
        server.draining = True  # /health 503 from this instant, before the drain's own log line
        if stop.is_set() or signum == signal.SIGINT:
            again.set()
        first.append(signum)
        stop.set()

    old = {s: signal.signal(s, handle) for s in (signal.SIGINT, signal.SIGTERM)}
    thread = server.serving  # an EngineServer serves from its creation
    try:
        while not stop.wait(0.2):
            if not thread.is_alive() or getattr(server.engine, "failure", None) is not None:
                break  # a dead engine stops the server (engine.py's run_serve exits 1)
        if first:
            drain(server, signal.Signals(first[0]).name, server.shutdown_delay, server.shutdown_timeout, again)
    finally:
        server.shutdown()
        server.server_close()
        if on_stop:
            on_stop()
        for s, h in old.items():
            signal.signal(s, h)
        stop.close()  # the handler that sets them is gone
        again.close()
