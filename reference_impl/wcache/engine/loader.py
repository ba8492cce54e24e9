"""The engine's ``ipc_cache`` loader: get this rank's weights from its daemon instead of the disk.

One attempt = connect, send ``get_state`` with the engine's cache key, receive the manifest and the
arena, bind every tensor as a view. Each way an attempt can fail has its own reason (see
errors.REASONS). With ``fallback`` on, the engine logs the reason and loads from disk; with it
off, it waits for a daemon that is still starting (no socket yet, or connection refused) and
fails on anything else.

In ``zero_copy`` mode the connection stays open for the engine's lifetime: it is the lease that
tells the daemon an engine still maps its memory. In ``copy`` mode the engine clones the arena,
asks the daemon to release its copy, and closes.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import sys
import time
from dataclasses import dataclass, fields, replace
from pathlib import Path

import torch

from wcache import errors
from wcache.core.config import EngineConfig
from wcache.core.device import device_identity
from wcache.errors import (
    CacheUnusable,
    LoaderConfigError,
    UnsupportedPlatformForIPCError,
    UnsupportedQuantForIPCError,
)
from wcache.core.fingerprint import cache_key
from wcache.wire.handback import ASK_TIMEOUT_S, HANDED_BACK_KINDS, ArenaOffer
from wcache.core.postprocess import ProcessedWeights
from wcache.wire.protocol import ProtocolError, close_fds, recv_frame, request, send_frame
from wcache.wire.sockets import check_socket_file, prepare_socket_dir, socket_name
from wcache.wire.transport import TRANSPORTS, bind_views, open_arena, resolve_transport

log = logging.getLogger("wcache.loader")

MODES = ("zero_copy", "copy")
RETRY_INTERVAL_S = 0.25
# Bounds NaN, Infinity (which Python's json accepts) and values that overflow a socket timeout.
MAX_TIMEOUT_S = 1e6


@dataclass(frozen=True)
class LoaderConfig:
    """Keys of ``--model-loader-extra-config``; names and defaults are upstream's."""

    mode: str = "zero_copy"
    fallback: bool = True
    socket_dir: str | None = None
    socket_path: str | None = None
    connect_timeout_s: float = 5.0
    state_timeout_s: float = 300.0
    transport: str = "auto"  # wcache's own key: require cuda_ipc or vmm_fd; auto takes what the daemon serves


LOADER_KEYS = {f.name: f.default for f in fields(LoaderConfig)}


def parse_loader_config(value: str | dict | None) -> LoaderConfig:
    """Validate the loader JSON: unknown keys and bad values are errors, never ignored."""
    if value is None or value == "":
        return LoaderConfig()
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise LoaderConfigError(f"--model-loader-extra-config is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise LoaderConfigError("--model-loader-extra-config must be a JSON object")
    unknown = sorted(set(value) - set(LOADER_KEYS))
    if unknown:
        raise LoaderConfigError(f"Unknown ipc_cache loader key(s) {unknown}; valid keys: {sorted(LOADER_KEYS)}")
    v = dict(value)
    if v.get("mode", "zero_copy") not in MODES:
        raise LoaderConfigError(f"mode must be one of {list(MODES)}, got {v['mode']!r}")
    if v.get("transport", "auto") not in TRANSPORTS:
        raise LoaderConfigError(f"transport must be one of {list(TRANSPORTS)}, got {v['transport']!r}")
    if not isinstance(v.get("fallback", True), bool):
        raise LoaderConfigError(f"fallback must be true or false, got {v['fallback']!r}")
    for k in ("socket_dir", "socket_path"):
        if v.get(k) is not None and (not isinstance(v[k], str) or not v[k]):
            raise LoaderConfigError(f"{k} must be a non-empty string path, got {v[k]!r}")
    for k in ("connect_timeout_s", "state_timeout_s"):
        if k in v and (isinstance(v[k], bool) or not isinstance(v[k], (int, float)) or not 0 < v[k] <= MAX_TIMEOUT_S):
            raise LoaderConfigError(f"{k} must be a positive number of seconds (at most {MAX_TIMEOUT_S:g}), got {v[k]!r}")
        if k in v:
            v[k] = float(v[k])
    return LoaderConfig(**v)


def resolve_socket_path(cfg: EngineConfig, lc: LoaderConfig, draft: bool = False) -> Path:
    if lc.socket_path:
        return Path(lc.socket_path)
    d = prepare_socket_dir(lc.socket_dir, create=False)
    return d / socket_name(device_identity(cfg.device, cfg.ranks.local_rank), draft)


class CacheClient:
    """One connection to a daemon rank."""

    def __init__(self, path: Path, lc: LoaderConfig):
        self.path = path
        self.lc = lc
        if not os.path.lexists(path):
            raise CacheUnusable("no_socket", path=path)
        try:
            check_socket_file(path)
        except OSError as e:
            raise CacheUnusable("unsafe_socket", path=path, error=e) from None
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(lc.connect_timeout_s)
        try:
            self.sock.connect(str(path))
        except OSError as e:
            self.sock.close()
            raise CacheUnusable("refused", path=path, error=e) from None
        self.sock.settimeout(lc.state_timeout_s)

    def call(self, op: str, **fields) -> tuple[dict, list[int]]:
        try:
            try:
                send_frame(self.sock, request(op, **fields))
            except ConnectionError as e:
                # The daemon hung up before reading the request; a refusal it sent first ("busy",
                # "rejected") is still queued on our side, so read it before blaming the daemon.
                try:
                    answer, fds = recv_frame(self.sock)
                except (ProtocolError, EOFError, OSError):
                    raise e from None
            else:
                answer, fds = recv_frame(self.sock)
        except TimeoutError:
            raise CacheUnusable("timeout", path=self.path, timeout=self.lc.state_timeout_s) from None
        except (EOFError, ConnectionError) as e:  # killed, crashed or stopped mid-handoff
            raise CacheUnusable("lost", path=self.path, error=str(e) or type(e).__name__) from None
        except (ProtocolError, OSError) as e:
            raise CacheUnusable("protocol", detail=str(e) or type(e).__name__) from None
        if not answer.get("ok"):
            close_fds(fds)
            kind = answer.get("error")
            if kind == "mismatch":
                raise CacheUnusable("mismatch", fields=answer.get("fields"))
            if kind == "released":
                raise CacheUnusable("released")
            if kind == "rejected":
                raise CacheUnusable("rejected", uid=os.getuid())  # the uid the daemon saw, outside user namespaces
            if kind == "busy":
                raise CacheUnusable("busy", path=self.path, detail=answer.get("message"))
            raise CacheUnusable("protocol", detail=f"{kind}: {answer.get('message')}")
        return answer, fds

    mapping = None  # the daemon's memory this engine maps (zero_copy); let go of it on close
    offer = None  # handback.ArenaOffer: gives the arena to a restarted daemon if this one dies

    def relink(self, sock: socket.socket) -> None:
        """Hold ``sock`` as the lease from now on (a restarted daemon serving the same arena)."""
        old, self.sock = self.sock, sock
        old.close()

    def close(self) -> None:
        if self.offer is not None:  # first: it watches the lease socket closed below
            self.offer.close()
            self.offer = None
        if self.mapping is not None:
            self.mapping.close()
            self.mapping = None
        self.sock.close()


def _check_supported(cfg: EngineConfig) -> None:
    if not sys.platform.startswith("linux"):
        raise UnsupportedPlatformForIPCError(sys.platform)
    if not cfg.quant.supports_pre_processed_weights:
        raise UnsupportedQuantForIPCError(cfg.quant.name)


def _attempt(cfg: EngineConfig, lc: LoaderConfig, key: dict, path: Path, phases: dict):
    """One handoff; ``phases`` receives the seconds each step took (the bench prints them)."""
    t = time.perf_counter()
    client = CacheClient(path, lc)
    phases["connect"], t = time.perf_counter() - t, time.perf_counter()
    kept = None
    try:
        answer, fds = client.call("get_state", key=key, mode=lc.mode)
        phases["request"], t = time.perf_counter() - t, time.perf_counter()
        engine_id = device_identity(cfg.device, cfg.ranks.local_rank)
        if answer.get("device_id") != engine_id:
            close_fds(fds)
            raise CacheUnusable("device", daemon=answer.get("device_id"), engine=engine_id)
        served = phases["transport"] = (answer.get("arena") or {}).get("kind")
        if lc.transport != "auto" and served != resolve_transport(lc.transport, cfg.torch_device):
            close_fds(fds)
            raise CacheUnusable("transport", served=served, wanted=lc.transport)
        # zero_copy keeps one descriptor of a memfd or VMM arena, to hand it back to a restarted
        # daemon (handback.py); open_arena closes the ones it receives.
        if lc.mode == "zero_copy" and served in HANDED_BACK_KINDS and len(fds) == 1 and answer["arena"].get("id"):
            kept = os.dup(fds[0])
        try:
            mapped = open_arena(answer.get("arena") or {}, fds, cfg.torch_device)
        except ProtocolError as e:
            raise CacheUnusable("protocol", detail=str(e)) from None
        except (OSError, RuntimeError) as e:  # mmap or cudaIpcOpenMemHandle refused (namespaces, permissions)
            raise CacheUnusable("map", error=e) from None
        client.mapping = mapped  # from here on, any failure lets go of it with client.close()
        phases["map"], t = time.perf_counter() - t, time.perf_counter()
        try:
            arena = mapped.tensor
            if lc.mode == "copy":
                # One device/host memcpy of the whole arena, then views of our own copy. Let go of
                # the daemon's memory before asking it to release, so the release really frees it.
                arena = arena.clone()
                if arena.is_cuda:
                    torch.cuda.synchronize(arena.device)
                mapped.close()
                phases["copy"], t = time.perf_counter() - t, time.perf_counter()
            tensors = bind_views(arena, answer.get("manifest") or {}, {})
            phases["bind"], t = time.perf_counter() - t, time.perf_counter()
        except ProtocolError as e:
            raise CacheUnusable("protocol", detail=str(e)) from None
        aliases = answer.get("aliases") or {}
        if any(t not in tensors for t in aliases.values()):
            raise CacheUnusable("protocol", detail="an alias names a tensor the daemon did not send")
        weights = ProcessedWeights(tensors, aliases, answer.get("attrs") or {})
        if lc.mode == "copy":
            try:
                client.call("release")
            except CacheUnusable as e:
                log.warning("The daemon kept its copy of the weights: %s", e)
            client.close()
            phases["release"] = time.perf_counter() - t
            return weights, None
        if kept is not None:
            client.offer = ArenaOffer(client.sock, answer, kept, key, path, lambda: _lease_again(path, lc, key),
                                      client.relink)
            kept = None
        return weights, client  # zero_copy: the open connection is our lease
    except BaseException:
        close_fds([kept] if kept is not None else [])
        client.close()
        raise


def _lease_again(path: Path, lc: LoaderConfig, key: dict):
    """(socket, answer, fds) of a zero_copy get_state on a restarted daemon; raises while none serves.
    Bounded by the hand-back's own timeout: while it waits, the engine answers no adopter."""
    client = CacheClient(path, replace(lc, connect_timeout_s=min(lc.connect_timeout_s, ASK_TIMEOUT_S),
                                       state_timeout_s=min(lc.state_timeout_s, ASK_TIMEOUT_S)))
    try:
        answer, fds = client.call("get_state", key=key, mode="zero_copy")
    except BaseException:
        client.close()
        raise
    return client.sock, answer, fds


def load_from_cache(cfg: EngineConfig, lc: LoaderConfig | None, draft: bool = False):
    """(weights, report) from the daemon, or (None, report with fallback_reason) to load from disk."""
    from wcache.engine.engine import LoadReport

    lc = lc or LoaderConfig()
    _check_supported(cfg)
    t0 = time.perf_counter()
    key = cache_key(cfg)
    phases = {"key": time.perf_counter() - t0}
    deadline = time.monotonic() + lc.state_timeout_s
    waited = False
    while True:
        try:
            path = resolve_socket_path(cfg, lc, draft)
            weights, lease = _attempt(cfg, lc, key, path, phases)
            break
        except CacheUnusable as e:
            reason = str(e)
            if lc.fallback:
                log.warning(errors.FALLBACK.format(reason=reason))
                return None, LoadReport("disk", 0.0, 0, 0, fallback_reason=reason)
            if e.kind not in errors.RETRYABLE:
                raise errors.WeightCacheError(reason) from None
            if time.monotonic() >= deadline:
                raise errors.WeightCacheTimeoutError(lc.state_timeout_s, reason) from None
            if not waited:
                log.info(errors.WAITING.format(timeout=lc.state_timeout_s))
                waited = True
            time.sleep(RETRY_INTERVAL_S)
    n = len(weights.tensors)
    log.info(errors.MAPPED.format(count=n, mode=lc.mode))
    external = weights.nbytes if lc.mode == "zero_copy" else 0
    report = LoadReport(f"the weight cache ({lc.mode})", 0.0, n, weights.nbytes, external_bytes=external, transport=phases.pop("transport"), phases=phases,
                        keepalive=[lease] if lease else [])
    return weights, report
