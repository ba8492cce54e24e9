"""Whether this process waits for the weight cache daemon: what ``/health`` says before the weights.

With ``"fallback": false`` the ipc_cache loader waits for a daemon that is not there yet (up to
``state_timeout_s``); /health then answers 503 ``{"status": "waiting_for_weight_cache", ...}``
instead of ``{"status": "loading"}``, so an operator (or a probe's log) tells a missing daemon
from a load in progress. The loader sets it and clears it; the HTTP server, in the same process,
reads it.
"""

from __future__ import annotations

import threading
import time

STATUS = "waiting_for_weight_cache"

_lock = threading.Lock()
_since: float | None = None
_state: dict | None = None
_listeners: list = []  # called with health_body() on every change (a --respawn worker tells its supervisor)


def subscribe(listener) -> None:
    _listeners.append(listener)


def _tell() -> None:
    body = health_body()
    for listener in _listeners:
        listener(body)


def set_waiting(socket_path: str | None, reason: str, timeout_s: float) -> None:
    """The loader's last failed attempt: why, and how long it waits in all (``state_timeout_s``)."""
    global _since, _state
    with _lock:
        if _since is None:
            _since = time.monotonic()
        _state = {"socket": socket_path, "reason": reason, "timeout_s": timeout_s}
    _tell()


def clear() -> None:
    global _since, _state
    with _lock:
        was, _since, _state = _state, None, None
    if was is not None:
        _tell()


def health_body() -> dict | None:
    """/health's body while the loader waits, else None."""
    with _lock:
        if _state is None:
            return None
        return {"status": STATUS, **_state, "waited_s": round(time.monotonic() - _since, 1)}
