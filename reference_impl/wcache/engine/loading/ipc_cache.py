"""The ``ipc_cache`` load format: this rank's weights from its daemon instead of the disk.

One attempt = connect (and check who answers, client.py), send ``get_state`` with the engine's
cache key, check the reply, map the arena, bind every tensor as a view. Each way an attempt can
fail has its own reason (errors.REASONS). With ``fallback`` on, the loader logs the reason and its
``DiskLoader`` loads from disk; with it off, it waits for a daemon that is still starting (no socket
yet, or connection refused) and fails on anything else.

In ``zero_copy`` mode the returned ``CacheLease`` keeps the connection open for the engine's
lifetime: it tells the daemon an engine still maps its memory. In ``copy`` mode the engine clones
the arena and binds its own copy; unmapping the daemon's memory, asking the daemon to release it and
closing happen on a thread of their own (``LoadReport.release``), off the engine's way to serving.

Python's cyclic garbage collector is paused for an attempt: decoding a 10,000-tensor manifest and
binding as many views make tens of thousands of objects, and the collections they would trigger
(each walking every object of an engine that has imported torch) cost more than the work itself.
Turning it back on would start a collection at the next allocation anyway (the young generation's
count is past its threshold): 1.3 ms of a 10,000-tensor load, measured, walking views that live as
long as the engine. So the objects alive then are frozen first (``gc.freeze``: moved to the
permanent generation, never walked again, still freed by reference counting). A reference cycle
alive at that moment is never collected; an engine has made its few by then, and keeps them.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

from wcache import errors
from wcache.core.background import Background
from wcache.core.config import EngineConfig
from wcache.core.device import device_identity
from wcache.core.fingerprint import cache_key
from wcache.core.postprocess import ProcessedWeights
from wcache.engine.loading.base import LoadedWeights, LoadReport, WeightLoader
from wcache.engine.loading.client import CacheClient
from wcache.engine.loading.config import LoaderConfig
from wcache.engine.loading.disk import DiskLoader
from wcache.engine.loading import waiting
from wcache.engine.loading.lease import CacheLease
from wcache.model.quant import refuse_for_cache
from wcache.errors import (
    CacheUnusable,
    UnsupportedPlatformForIPCError,
)
from wcache.wire.arena import bind_views, groups_bytes
from wcache.wire.arenas import HANDED_BACK_KINDS, open_arena
from wcache.wire.handback import ASK_TIMEOUT_S
from wcache.wire.protocol import ProtocolError, close_fds
from wcache.wire.sockets import prepare_socket_dir, socket_path_for
from wcache.wire.transports.auto import resolve_transport

log = logging.getLogger("wcache.engine.loader")

RETRY_INTERVAL_S = 0.25


def resolve_socket_path(cfg: EngineConfig, lc: LoaderConfig, draft: bool = False) -> Path:
    if lc.socket_path:
        return Path(lc.socket_path)
    d = prepare_socket_dir(lc.socket_dir, create=False)
    return socket_path_for(d, device_identity(cfg.device, cfg.ranks.local_rank), draft)


def check_supported(cfg: EngineConfig) -> None:
    if not sys.platform.startswith("linux"):
        raise UnsupportedPlatformForIPCError(sys.platform)
    refuse_for_cache(cfg.quant)


class IpcCacheLoader(WeightLoader):
    def __init__(self, loader_config: LoaderConfig | None = None, draft: bool = False):
        super().__init__(loader_config or LoaderConfig(), draft)
        self.disk = DiskLoader(None, draft)  # the fallback

    def load(self, cfg: EngineConfig) -> LoadedWeights:
        t0 = time.perf_counter()
        check_supported(cfg)
        try:
            with _collector_paused():
                weights, lease, phases, release = self._until_served(cfg)
        except CacheUnusable as e:  # fallback on: say why, then read the disk
            log.warning(errors.FALLBACK.format(reason=e))
            return self.disk.load(cfg, fallback_reason=str(e), t0=t0, fallback_kind=e.kind)
        mode = self.loader_config.mode
        n = len(weights.tensors)
        log.info(errors.MAPPED.format(count=n, mode=mode))
        nbytes = phases.pop("nbytes")
        report = LoadReport(f"the weight cache ({mode})", time.perf_counter() - t0, n, nbytes,
                            external_bytes=lease.external_bytes if lease else 0,
                            transport=phases.pop("transport"), phases=phases, release=release)
        return LoadedWeights(weights, report, lease)

    def _until_served(self, cfg: EngineConfig) -> tuple[ProcessedWeights, CacheLease | None, dict, Background | None]:
        """Attempt until served. CacheUnusable only with fallback on; with it off, a reason not
        worth waiting for, or the wait's end, is a user error."""
        lc = self.loader_config
        key: dict = {}  # the cache key, computed once by the first attempt that connects
        phases: dict = {}
        deadline = time.monotonic() + lc.state_timeout_s
        waited = False
        try:
            while True:
                path = None
                try:
                    path = resolve_socket_path(cfg, lc, self.draft)
                    weights, lease, release = self._attempt(cfg, key, path, phases)
                    return weights, lease, phases, release
                except CacheUnusable as e:
                    if lc.fallback:
                        raise
                    if e.kind not in errors.RETRYABLE:
                        raise errors.WeightCacheError(str(e)) from None
                    if time.monotonic() >= deadline:
                        raise errors.WeightCacheTimeoutError(lc.state_timeout_s, str(e)) from None
                    # /health says so (before the log line, which a reader may wait for first)
                    waiting.set_waiting(None if path is None else str(path), str(e), lc.state_timeout_s)
                    if not waited:
                        log.info(errors.WAITING.format(timeout=lc.state_timeout_s))
                        waited = True
                    time.sleep(RETRY_INTERVAL_S)
        finally:
            waiting.clear()

    # -- one attempt, step by step; ``phases`` receives the seconds of each (the bench prints them)
    def _attempt(self, cfg: EngineConfig, key: dict, path: Path, phases: dict):
        lc = self.loader_config
        clock = _Clock(phases)
        lease = CacheLease(CacheClient(path, lc))  # from here on, any failure lets go of it all
        clock.lap("connect")
        try:
            if not key:  # after connecting: meanwhile the daemon starts this connection's thread
                key.update(cache_key(cfg))
                clock.lap("key")
            answer, fds = lease.call("get_state", key=key, mode=lc.mode)
            clock.lap("request")
            lease.kind = phases["transport"] = self._check_reply(cfg, answer, fds)
            if lc.mode == "zero_copy" and lease.kind in HANDED_BACK_KINDS and len(fds) == 1 and answer["arena"].get("id"):
                lease.keep_descriptor(fds[0])  # for handback.py; open_arena closes the ones it receives
            lease.mapping = self._map(answer, fds, cfg)
            clock.lap("map")
            weights = self._bind(lease, answer, clock)
            phases["nbytes"] = _weights_bytes(weights, answer)
            if lc.mode == "copy":
                release = Background(self._release, lease, finish_before_exit=True)
                clock.lap("release")  # only the start: the engine has its own copy already
                return weights, None, release
            lease.external_bytes = phases["nbytes"]
            lease.offer_back(answer, key, lambda: _lease_again(path, lc, key))
            return weights, lease, None
        except BaseException:
            lease.close()
            raise

    def _check_reply(self, cfg: EngineConfig, answer: dict, fds: list[int]) -> str:
        """The arena kind served, once the reply is for this device and the transport asked for."""
        engine_id = device_identity(cfg.device, cfg.ranks.local_rank)
        if answer.get("device_id") != engine_id:
            close_fds(fds)
            raise CacheUnusable("device", daemon=answer.get("device_id"), engine=engine_id)
        served = (answer.get("arena") or {}).get("kind")
        wanted = self.loader_config.transport
        if wanted != "auto" and served != resolve_transport(wanted, cfg.torch_device):
            close_fds(fds)
            raise CacheUnusable("transport", served=served, wanted=wanted)
        return served

    @staticmethod
    def _map(answer: dict, fds: list[int], cfg: EngineConfig):
        try:
            return open_arena(answer.get("arena") or {}, fds, cfg.torch_device)
        except ProtocolError as e:
            raise CacheUnusable("protocol", detail=str(e)) from None
        except (OSError, RuntimeError) as e:  # mmap or cudaIpcOpenMemHandle refused (namespaces, permissions)
            raise CacheUnusable("map", error=e) from None

    def _bind(self, lease: CacheLease, answer: dict, clock: _Clock) -> ProcessedWeights:
        """Views of every tensor: of the daemon's memory (zero_copy), or of our own clone (copy)."""
        arena = lease.mapping.tensor
        copy = self.loader_config.mode == "copy"
        if copy:
            # One device/host memcpy of the whole arena, then views of our own copy. On a GPU the copy
            # runs on the stream while the views are bound (they are only shapes and offsets); the
            # wait for it comes after. The daemon's memory is let go of by _release, in the background.
            arena = arena.clone()
            clock.lap("copy")
        try:
            tensors = bind_views(arena, answer.get("manifest") or {})
        except ProtocolError as e:
            raise CacheUnusable("protocol", detail=str(e)) from None
        clock.lap("bind")
        if copy and arena.is_cuda:
            torch.cuda.synchronize(arena.device)
            clock.lap("copy", add=True)  # the copy: its launch, then what binding did not hide
        aliases = answer.get("aliases") or {}
        if any(t not in tensors for t in aliases.values()):
            raise CacheUnusable("protocol", detail="an alias names a tensor the daemon did not send")
        return ProcessedWeights(tensors, aliases, answer.get("attrs") or {})

    @staticmethod
    def _release(lease: CacheLease) -> None:
        """Copy mode, once the engine has its own copy: unmap the daemon's memory first, so that the
        release really frees it, then ask for the release and close."""
        try:
            lease.release_mapping()
            lease.call("release")
        except CacheUnusable as e:
            log.warning("The daemon kept its copy of the weights: %s", e)
        except Exception:  # a driver error unmapping: the engine serves from its own copy anyway
            log.exception("Letting go of the daemon's memory failed")
        finally:
            lease.close()


def _weights_bytes(weights: ProcessedWeights, answer: dict) -> int:
    """The manifest's sum, group by group (summing 10,000 tensors one by one takes milliseconds);
    the tensors' own sum where the manifest names a tensor twice (bound once, counted once)."""
    groups = answer["manifest"]["groups"]  # bind_views has checked them
    if sum(len(g["names"]) for g in groups) == len(weights.tensors):
        return groups_bytes(groups)
    return weights.nbytes


@contextlib.contextmanager
def _collector_paused():
    """No cyclic garbage collection inside; afterwards what was made is frozen, then the collector is
    as it was (see the module's docstring)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.freeze()
            gc.enable()


class _Clock:
    def __init__(self, phases: dict):
        self.phases, self.t = phases, time.perf_counter()

    def lap(self, name: str, add: bool = False) -> None:
        """The seconds since the last lap, as phase ``name`` (added to it with ``add``)."""
        now = time.perf_counter()
        self.phases[name] = now - self.t + (self.phases.get(name, 0.0) if add else 0.0)
        self.t = now


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
