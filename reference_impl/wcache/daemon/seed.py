"""Seeding between daemons: a running daemon serves its tuned autotune cache over TCP, and a new
replica's daemon pulls it instead of tuning again.

Source: ``--weight-cache-seed-listen HOST:BASE_PORT --weight-cache-seed-token TOKEN``; rank g
listens on BASE_PORT + g. Replica: ``--weight-cache-seed HOST:PORT[,...]``, one address per local
rank in local-rank order, with the same token. The replica dials before its own autotune pass;
whatever goes wrong (unreachable, wrong token, another configuration, no cache on the source) is
logged with its own message and the replica tunes locally.

Wire format: one request and one reply per connection, each an 8-byte big-endian length and a JSON
object (``wcache.wire.protocol``; no pickle). The token is compared in constant time (HMAC compare of
SHA-256 digests, so not even its length leaks) before the request's command is looked at. Only
read-only fetches exist (``ping``, ``get_autotune``). Requests are bounded to ``MAX_REQUEST_BYTES``,
replies to the autotune cache size limit, connections to ``MAX_CONNECTIONS`` at a time and
``TIMEOUT_S`` each. A peer address that sent ``BAD_TOKEN_LIMIT`` bad tokens within
``BAD_TOKEN_WINDOW_S`` is refused until the window passes, and every bad token costs its sender
``BAD_TOKEN_DELAY_S``.
"""

from __future__ import annotations

import collections
import hashlib
import hmac
import logging
import socket
import threading
import time
from pathlib import Path

from wcache.core import autotune
from wcache.core.config import EngineConfig
from wcache.errors import SEED_BUSY, SEED_FALLBACK, SEED_REASONS, SEEDED, SeedConfigError
from wcache.core.fingerprint import mismatched_fields
from wcache.daemon.seed_settings import TOKEN_ENV, parse_address  # noqa: F401 (TOKEN_ENV: named here too)
from wcache.wire.protocol import (
    ProtocolError,
    close_fds,
    drain,
    recv_frame,
    reply,
    request,
    send_frame,
)

log = logging.getLogger("wcache.seed")

SERVED_OPS = ("ping", "get_autotune", "get_weights")  # get_weights: weight_source.py
MAX_REQUEST_BYTES = 64 << 10
MAX_CONNECTIONS = 16
TIMEOUT_S = 10.0
CONNECT_TIMEOUT_S = 5.0
BAD_TOKEN_LIMIT = 5
BAD_TOKEN_WINDOW_S = 60.0
BAD_TOKEN_DELAY_S = 0.2


def _digest(token) -> bytes:
    # surrogatepass: a JSON string may hold a lone surrogate, which plain UTF-8 refuses to encode.
    return hashlib.sha256(token.encode("utf-8", "surrogatepass") if isinstance(token, str) else b"\0invalid").digest()


# -- the source side -----------------------------------------------------------------------------
class SeedServer:
    """Serves one rank's autotune cache document (``get_doc()``; None when it has none)."""

    def __init__(self, host: str, port: int, token: str, get_doc, rank: int, counted=None, weights=None):
        self.address = f"{host}:{port}"
        self.weights = weights  # a weight_source.WeightSource, or None: get_weights is then refused
        self.counted = counted  # told each answer (daemon/metrics.py counts served and refused requests)
        self.token_digest = _digest(token)
        self.get_doc = get_doc
        self.rank = rank
        self.stop = threading.Event()
        self.slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self.bad: dict[str, collections.deque] = {}
        self.bad_lock = threading.Lock()
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self.sock.bind((host, port))
        except OSError as e:
            self.sock.close()
            raise SeedConfigError(SeedConfigError.PORT_IN_USE.format(address=self.address, error=e)) from None
        self.sock.listen(64)
        self.sock.settimeout(0.2)
        self.thread = threading.Thread(target=self._accept, name="seed-server", daemon=True)

    def start(self) -> SeedServer:
        self.thread.start()
        log.info("Rank %d serves its autotune cache to seeding replicas on %s", self.rank, self.address)
        return self

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=2)
        self.sock.close()

    def _answer(self, conn: socket.socket, answer: dict) -> None:
        if self.counted is not None:
            self.counted(answer)
        send_frame(conn, answer)

    def _limited(self, peer: str) -> bool:
        now = time.monotonic()
        with self.bad_lock:
            q = self.bad.get(peer)
            while q and now - q[0] > BAD_TOKEN_WINDOW_S:
                q.popleft()
            if q is not None and not q:
                del self.bad[peer]
            return bool(q) and len(q) >= BAD_TOKEN_LIMIT

    def _record_bad(self, peer: str) -> None:
        with self.bad_lock:
            self.bad.setdefault(peer, collections.deque()).append(time.monotonic())
            if len(self.bad) > 4096:  # bound the table itself; forget the oldest entry
                self.bad.pop(next(iter(self.bad)))

    def _accept(self) -> None:
        while not self.stop.is_set():
            try:
                conn, addr = self.sock.accept()
            except TimeoutError:
                continue
            except OSError as e:
                if self.stop.is_set():
                    return
                # Out of descriptors (EMFILE/ENFILE): accepting again at once would spin. Pause
                # (doubling to 1 s) and log once per 10 s, as the rank's own listener does.
                pause = min(1.0, max(0.05, getattr(self, "_pause", 0.0) * 2))
                self._pause = pause
                now = time.monotonic()
                if now - getattr(self, "_logged", 0.0) >= 10.0:
                    log.warning("Seed listener cannot accept connections (%s); pausing %.2f s", e, pause)
                    self._logged = now
                self.stop.wait(pause)
                continue
            self._pause = 0.0
            if not self.slots.acquire(blocking=False):
                try:  # say why before closing; a fresh connection's send buffer takes this at once
                    conn.settimeout(1.0)
                    self._answer(conn, reply(False, error="busy", message=SEED_BUSY.format(max=MAX_CONNECTIONS)))
                except OSError:
                    pass
                conn.close()
                continue
            threading.Thread(target=self._serve, args=(conn, addr[0]), daemon=True).start()

    def _serve(self, conn: socket.socket, peer: str) -> None:
        try:
            conn.settimeout(TIMEOUT_S)
            if self._limited(peer):
                self._answer(conn, reply(False, error="rate_limited", message="too many bad tokens; retry later"))
                drain(conn)  # refused unread: without draining, the reset could swallow the answer
                return
            try:
                req, fds = recv_frame(conn, max_bytes=MAX_REQUEST_BYTES, timeout=TIMEOUT_S)  # a whole-frame deadline
            except (ProtocolError, EOFError, TimeoutError) as e:
                self._answer(conn, reply(False, error="protocol", message=str(e)[:200]))
                drain(conn)
                return
            close_fds(fds)  # TCP carries none, but never keep one
            # The token first: nothing else of the request is looked at without it.
            if not hmac.compare_digest(_digest(req.get("token")), self.token_digest):
                self._record_bad(peer)
                log.warning("Seed request from %s with a bad token refused", peer)
                time.sleep(BAD_TOKEN_DELAY_S)
                self._answer(conn, reply(False, error="token", message="bad token"))
                return
            op = req.get("op")
            if op not in SERVED_OPS:
                self._answer(conn, reply(False, error="forbidden", message=f"only {list(SERVED_OPS)} are served "
                                       "remotely"))
                return
            if op == "get_weights":
                if self.weights is None:
                    self._answer(conn, reply(False, error="forbidden", message="this daemon serves no weights"))
                else:
                    self.weights.serve(conn, req, peer)
                return
            doc = self.get_doc()
            if op == "ping":
                self._answer(conn, reply(True, rank=self.rank, has_cache=doc is not None))
                return
            key = req.get("key")
            if not isinstance(key, dict):
                self._answer(conn, reply(False, error="protocol", message="get_autotune needs a key object"))
                return
            if doc is None:
                self._answer(conn, reply(False, error="no_cache", message="this daemon has no autotune cache"))
                return
            fields = mismatched_fields(doc["key"], key)
            if fields:
                self._answer(conn, reply(False, error="mismatch", fields=fields[:64]))
                return
            self._answer(conn, reply(True, doc=doc))
            log.info("Served the autotune cache (%d configs) to %s", len(doc["configs"]), peer)
        except (OSError, ProtocolError):
            pass
        finally:
            conn.close()
            self.slots.release()


# -- the replica side ----------------------------------------------------------------------------
class SeedFailure(Exception):
    def __init__(self, kind: str, **fields):
        self.kind = kind
        super().__init__(SEED_REASONS[kind].format(**fields))


def fetch(address: str, token: str, key: dict, timeout: float = CONNECT_TIMEOUT_S) -> dict:
    """The source's cache document for ``key``; SeedFailure with the reason otherwise."""
    host, port = parse_address(address, "--weight-cache-seed")
    try:
        sock = socket.create_connection((host, port), timeout=timeout)
    except OSError as e:
        raise SeedFailure("unreachable", address=address, error=e) from None
    try:
        sock.settimeout(TIMEOUT_S)
        send_frame(sock, request("get_autotune", token=token, key=key))
        answer, _ = recv_frame(sock, max_bytes=autotune.MAX_CACHE_BYTES + 4096)
    except (OSError, EOFError, ProtocolError) as e:
        raise SeedFailure("protocol", address=address, detail=str(e) or type(e).__name__) from None
    finally:
        sock.close()
    if not answer.get("ok"):
        kind = answer.get("error")
        if kind == "mismatch":
            raise SeedFailure("mismatch", address=address, fields=answer.get("fields"))
        if kind in ("token", "no_cache", "rate_limited"):
            raise SeedFailure(kind, address=address)
        raise SeedFailure("protocol", address=address, detail=f"{kind}: {str(answer.get('message'))[:200]}")
    try:
        return autotune.validate(answer.get("doc"), key)
    except autotune.AutotuneError as e:
        raise SeedFailure("protocol", address=address, detail=str(e)) from None


def pull(cfg: EngineConfig, address: str, token: str) -> Path | None:
    """Fetch this rank's cache from ``address`` and save it where the autotune pass will find it.
    Returns the path, or None (after logging why) so the caller tunes locally."""
    key = autotune.tune_key(cfg)
    try:
        doc = fetch(address, token, key)
    except SeedFailure as e:
        log.warning(SEED_FALLBACK.format(reason=e))
        return None
    path = autotune.cache_path(cfg, key)
    try:
        autotune.save(path, {**doc, "seeded_from": address})
    except autotune.AutotuneError as e:
        log.warning("Could not store the seeded autotune cache: %s", e)
        return None
    log.info(SEEDED.format(address=address, n=len(doc["configs"])))
    return path
