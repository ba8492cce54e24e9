"""The API key: ``--api-key`` (vLLM's flag) or the ``VLLM_API_KEY`` environment variable.

As vLLM does, a key guards the ``/v1/`` routes only: ``/health`` (and the other operational routes)
stay open for probes. The flag wins over the variable; an empty variable is as if unset (vLLM's
rule), an empty flag is refused. The server keeps only each key's SHA-256, and compares what a
request offers with every one in constant time (``hmac.compare_digest`` over digests of one length),
so neither the time an answer takes nor a log line or a traceback gives a key away. The variable is
the safer way to pass a key: a flag shows in ``ps`` to every user of the host.
"""

from __future__ import annotations

import hashlib
import hmac
import os

from wcache.errors import API_KEY_EMPTY, API_KEY_MISSING, API_KEY_WRONG, UserError

ENV = "VLLM_API_KEY"
GUARDED_PREFIX = "/v1/"


def _digest(key: bytes) -> bytes:
    return hashlib.sha256(key).digest()


class ApiKeys:
    """The keys a request may offer as ``Authorization: Bearer KEY``; none means an open server."""

    def __init__(self, keys=()):
        self._digests = tuple(_digest(k.encode("utf-8")) for k in keys)

    def __bool__(self) -> bool:
        return bool(self._digests)

    def __repr__(self) -> str:  # never the keys
        return f"ApiKeys({len(self._digests)} key(s))"

    @staticmethod
    def guards(path: str) -> bool:
        return path == "/v1" or path.startswith(GUARDED_PREFIX)

    def refusal(self, path: str, authorization: str | None) -> str | None:
        """Why a request for ``path`` with this ``Authorization`` header is refused (a 401), or None."""
        if not self._digests or not self.guards(path):
            return None
        scheme, _, offered = (authorization or "").strip().partition(" ")
        if scheme.lower() != "bearer" or not offered.strip():
            return API_KEY_MISSING
        # http.server decodes header bytes as latin-1: encoding back gives the bytes the client sent
        offered_digest = _digest(offered.strip().encode("latin-1", errors="replace"))
        ok = False
        for d in self._digests:  # every key is compared, whichever matches
            ok |= hmac.compare_digest(d, offered_digest)
        return None if ok else API_KEY_WRONG


def from_flag_or_env(flag: list[str] | None, environ=os.environ) -> ApiKeys:
    if flag is not None:
        if not flag or any(not k for k in flag):
            raise UserError(API_KEY_EMPTY)
        return ApiKeys(flag)
    env = environ.get(ENV)
    return ApiKeys([env] if env else [])
