"""The engine's HTTP API as every bench measurement calls it, on loopback: a free port to start
`wcache serve` on, GET /health, and one POST /v1/completions on a fresh connection."""

from __future__ import annotations

import json
import socket
import urllib.request


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def healthy(port: int) -> bool:
    """Whether GET /health answers 200 within a second."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
            return r.status == 200
    except OSError:
        return False


def complete(port: int, prompt: str, max_tokens: int, timeout: float) -> tuple[int, bytes]:
    """One completion on a fresh connection: the HTTP status and the body. A status of 400 or more
    raises urllib.error.HTTPError, as urlopen does."""
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", method="POST",
                                 data=json.dumps({"prompt": prompt, "max_tokens": max_tokens}).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return r.status, r.read()
