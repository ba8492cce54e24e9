"""One line per request, at INFO on the ``wcache.access`` logger, written when its answer ends:

    request 5f0c... POST /v1/completions 200 prompt_tokens=6 generation_tokens=8 ttft_ms=3.1 total_ms=12.4

The request id is the one echoed in ``X-Request-Id`` (engine/api_server/request_id.py), so a client's report
finds its line. Token counts and the time to first token are ``-`` for requests that generate
nothing (``/health``, a refusal). A completion whose client left is logged with status 499 (nginx's
"client closed request"): it had no answer to send, and its generation tokens say where decoding
stopped. ``wcache serve --disable-log-requests`` turns the lines off.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

log = logging.getLogger("wcache.access")

CLIENT_CLOSED = 499  # nginx's status for a request whose client closed the connection first


@dataclass
class RequestRecord:
    """What a request did, filled in by the front door and the route as it goes."""

    request_id: str
    method: str
    path: str
    started: float  # monotonic, at the request's first byte
    status: int | None = None
    prompt_tokens: int | None = None
    generation_tokens: int | None = None
    first_token: float | None = None  # monotonic

    def token(self) -> None:
        if self.first_token is None:
            self.first_token = time.monotonic()

    def line(self, now: float | None = None) -> str:
        now = time.monotonic() if now is None else now
        ttft = "-" if self.first_token is None else f"{(self.first_token - self.started) * 1000:.1f}"
        return (f"request {self.request_id} {self.method} {self.path[:200]} {self.status or '-'} "
                f"prompt_tokens={_n(self.prompt_tokens)} generation_tokens={_n(self.generation_tokens)} "
                f"ttft_ms={ttft} total_ms={(now - self.started) * 1000:.1f}")


def _n(v: int | None) -> str:
    return "-" if v is None else str(v)
