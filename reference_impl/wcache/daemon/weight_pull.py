"""The replica side of weight seeding: a new daemon rank takes its weights from a running one.

When: the rank was given a seed address (``--weight-cache-seed``) and ``--weight-cache-seed-weights``
says so: ``auto`` (the default) seeds when the model directory holds no shards, ``always`` seeds
even when it does (a network faster than the disk), ``never`` keeps the disk.

What is checked, in order, each failure with its own message (errors.SEED_WEIGHTS_REASONS): the
token (by the source, seed.py), the cache key both ways (the source refuses another key, and the
replica checks the key the source answers with, field by field; without shards, the checkpoint
digest is recomputed from the source's shard list and must be the source's), the layout (the bytes
offered must be what the manifest needs, not more), the stream (a stall, an early close, a byte more
than announced) and, before anything is packed or served, every chunk's digest. A failed seed is
never served: the rank loads its own shards if it has them, or exits 2 (weight_pull.load_weights).
"""

from __future__ import annotations

import json
import logging
import socket
import time
from dataclasses import dataclass

import torch

from wcache.core import seeded_checkpoint
from wcache.core.distributed import join_daemon_world
from wcache.core.fingerprint import (
    cache_key,
    cache_root,
    checkpoint_digest,
    combine,
    mismatched_fields,
)
from wcache.daemon import seed_round, weight_digest
from wcache.daemon.seed import CONNECT_TIMEOUT_S
from wcache.daemon.seed_settings import parse_address
from wcache.daemon.seed_target import make_target
from wcache.errors import (
    SEED_WEIGHTS_FALLBACK,
    SEED_WEIGHTS_FATAL,
    SEED_WEIGHTS_REASONS,
    SEEDED_WEIGHTS,
    SEEDING_PHASES,
    WEIGHTS_FROM_DISK,
    UserError,
)
from wcache.wire.arena import DTYPES, Layout, groups_bytes
from wcache.wire.protocol import ProtocolError, recv_frame, reply, request, send_frame
from wcache.wire.transports.auto import resolve_transport

log = logging.getLogger("wcache.seed")

MODES = ("auto", "always", "never")
DEFAULT_STALL_S = 30.0
QUEUE_WAIT_S = 600.0  # a replica queued behind a running round waits this long for its own
MAX_HEADER_BYTES = 64 << 20
SIZE_GRANULE = 2 << 20  # an arena is its layout rounded up to a page, or to a VMM granularity (2 MiB)
RECV_STEP = 4 << 20  # a piece received, hashed and written while it is in the cache


class SeedWeightsError(Exception):
    def __init__(self, kind: str, **fields):
        self.kind = kind
        super().__init__(SEED_WEIGHTS_REASONS[kind].format(**fields))


@dataclass
class Seeded:
    arena: object
    key: dict
    shards: dict
    aliases: dict
    attrs: dict
    weights_bytes: int
    how: str
    seconds: float
    sent: int
    phases: dict


def wanted(spec: dict, model: str) -> bool:
    mode = spec.get("seed_weights") or "auto"
    if not spec.get("seed") or mode == "never":
        return False
    return mode == "always" or not seeded_checkpoint.has_shards(model)


def replica_key(cfg, shards_present: bool) -> dict:
    """This rank's cache key; without shards, no checkpoint digest (the small files stand for it)."""
    if shards_present:
        return cache_key(cfg, checkpoint_digest(cfg.model)[0])
    return {**cache_key(cfg, "unknown"), "checkpoint": None}


# -- the exchange ----------------------------------------------------------------------------------
def _answer(sock: socket.socket, address: str, stall_s: float) -> dict:
    try:
        header, _ = recv_frame(sock, max_bytes=MAX_HEADER_BYTES, timeout=stall_s)
        if header.get("ok") and header.get("queued"):
            log.info("The weight cache seed at %s is serving another round; queued for the next", address)
            sock.settimeout(QUEUE_WAIT_S)
            header, _ = recv_frame(sock, max_bytes=MAX_HEADER_BYTES, timeout=stall_s)
            sock.settimeout(stall_s)
    except TimeoutError:
        raise SeedWeightsError("stalled", address=address, seconds=stall_s, got=0, size="?") from None
    except EOFError:
        raise SeedWeightsError("closed", address=address, got=0, size="?") from None
    if header.get("ok"):
        return header
    kind = header.get("error")
    if kind == "mismatch":
        raise SeedWeightsError("mismatch", address=address, fields=header.get("fields"))
    if kind in ("token", "released", "rate_limited"):
        raise SeedWeightsError(kind, address=address)
    if kind == "busy":
        raise SeedWeightsError("busy", address=address, detail=str(header.get("message"))[:200])
    raise SeedWeightsError("protocol", address=address, detail=f"{kind}: {str(header.get('message'))[:200]}")


def _check(header: dict, mine: dict, model: str, device: torch.device, address: str) -> Layout:
    """The source's answer, checked before a byte is received: its key, its layout, its digests."""
    bad = lambda detail: SeedWeightsError("protocol", address=address, detail=detail)
    theirs, shards = header.get("key"), header.get("shards")
    if not isinstance(theirs, dict) or not isinstance(shards, dict):
        raise bad("no key or shard list")
    fields = mismatched_fields({**mine, "checkpoint": None}, {**theirs, "checkpoint": None})
    if mine["checkpoint"] is not None and mine["checkpoint"] != theirs.get("checkpoint"):
        fields.append("checkpoint")
    if mine["checkpoint"] is None:  # without shards: the digest must follow from the list it sent
        names = seeded_checkpoint.listed_shards(model)
        config = seeded_checkpoint.config_entry(model)
        try:
            recomputed = combine({**shards, "config.json": config}) if sorted(shards) == names else None
        except (TypeError, IndexError):
            recomputed = None
        if recomputed is None or recomputed != theirs.get("checkpoint"):
            fields.append("checkpoint")
    if fields:
        raise SeedWeightsError("mismatch", address=address, fields=fields[:64])
    size = header.get("size")
    try:
        layout = Layout.from_manifest(header["manifest"], size)
        needed = max((g["offset"] + g["step"] * (len(g["names"]) - 1)
                      + DTYPES[g["dtype"]].itemsize * _numel(g["shape"]) for g in layout.groups), default=0)
        weights_bytes = groups_bytes(layout.groups)
    except (ProtocolError, KeyError, TypeError) as e:
        raise bad(str(e)[:200]) from None
    if size > -(-needed // SIZE_GRANULE) * SIZE_GRANULE:
        raise SeedWeightsError("oversize", address=address, size=size, needed=needed)
    if size < needed or header.get("weights_bytes") != weights_bytes:
        raise bad(f"the manifest needs {needed} bytes and holds {weights_bytes}; the source offers {size} "
                  f"and says {header.get('weights_bytes')!r}")
    d = header.get("digests")
    if not isinstance(d, dict) or d.get("algorithm") not in weight_digest.accepted(device.type) \
            or not isinstance(d.get("chunk_bytes"), int) or not 1 << 20 <= d["chunk_bytes"] <= 1 << 30 \
            or not isinstance(d.get("chunks"), list) or len(d["chunks"]) != -(-size // d["chunk_bytes"]):
        raise bad("digests missing or not one per chunk")
    return layout


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _receive_stream(sock: socket.socket, target, size: int, address: str, stall_s: float,
                    checker: weight_digest.Checker) -> None:
    """Exactly the arena's bytes, then end-of-stream: a stall, an early close or a byte more is an error.
    Each piece is hashed (``checker``) and handed to the target as soon as it is complete."""
    got = 0  # bytes received, the piece in hand included
    try:
        while got < size:
            start = got
            view = target.into(start, min(size - start, RECV_STEP))
            while got - start < len(view):
                k = sock.recv_into(view[got - start:], len(view) - (got - start))
                if k == 0:
                    raise SeedWeightsError("closed", address=address, got=got, size=size)
                got += k
            checker.feed(view)
            target.landed(start, view)
        if sock.recv(1):
            raise SeedWeightsError("oversent", address=address, size=size)
    except TimeoutError:
        raise SeedWeightsError("stalled", address=address, seconds=stall_s, got=got, size=size) from None


def _receive_round(sock: socket.socket, header: dict, target, size: int, checker, address: str) -> None:
    r = header.get("round")
    try:
        store_host, port = r["store"]
        my_host = sock.getsockname()[0]  # this side's address on the route to the source
        chunk = int(r.get("chunk_bytes", seed_round.ROUND_CHUNK_BYTES))
        if not 1 << 20 <= chunk <= 1 << 30:
            raise ValueError(f"chunk_bytes {chunk}")
        seed_round.receive(store_host, int(port), str(r["prefix"]), int(r["rank"]), int(r["world"]), my_host,
                           size, target, checker, chunk)
    except (TypeError, KeyError, ValueError) as e:
        raise SeedWeightsError("protocol", address=address, detail=f"bad round {str(r)[:200]}: {e}") from None
    except RuntimeError as e:  # gloo: a peer stalled, died or closed
        raise SeedWeightsError("round", address=address, error=str(e).splitlines()[0][:300]) from None


def pull(address: str, token: str, cfg, kind: str, shards_present: bool, stall_s: float = DEFAULT_STALL_S) -> Seeded:
    host, port = parse_address(address, "--weight-cache-seed")
    device = cfg.torch_device
    key = replica_key(cfg, shards_present)
    t0, sent0 = time.perf_counter(), seed_round.bytes_written()
    try:
        sock = socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_S)
    except OSError as e:
        raise SeedWeightsError("unreachable", address=address, error=e) from None
    target = None
    try:
        sock.settimeout(stall_s)
        send_frame(sock, request("get_weights", token=token, key=key,
                                 small=seeded_checkpoint.small_identity(cfg.model)))
        header = _answer(sock, address, stall_s)
        layout = _check(header, key, cfg.model, device, address)
        marks = [("header", time.perf_counter())]
        target = make_target(kind, header["size"], device)
        marks.append(("allocate", time.perf_counter()))
        size = header["size"]
        checker = weight_digest.Checker(target.buffer, header["digests"], size,
                                        device if device.type == "cuda" else None)
        try:
            if header.get("transfer") == "round":
                _receive_round(sock, header, target, size, checker, address)
                how = f"fan-out round of {header['round']['world']} ranks"
            else:
                _receive_stream(sock, target, size, address, stall_s, checker)
                how = "TCP stream"
            marks.append(("receive", time.perf_counter()))
            bad = checker.bad()
            marks.append(("verify", time.perf_counter()))
        finally:
            checker.close()
        if bad:
            raise SeedWeightsError("digest", address=address, chunks=bad[:8], total=len(header["digests"]["chunks"]))
        written = target.written
        arena = target.finish(layout, header.get("aliases") or {}, header.get("attrs") or {}, header["weights_bytes"])
        target = None
        marks.append(("pack", time.perf_counter()))
        _quietly(send_frame, sock, reply(True, verified=True))
        phases = {name: round(t - prev, 4) for (name, t), prev in zip(marks, [t0] + [t for _, t in marks])}
        return Seeded(arena, header["key"], header["shards"], header.get("aliases") or {}, header.get("attrs") or {},
                      header["weights_bytes"], how, time.perf_counter() - t0, seed_round.bytes_written() - sent0 - written,
                      phases)
    except SeedWeightsError as e:
        _quietly(send_frame, sock, reply(False, verified=False, reason=str(e)[:300]))
        raise
    except (OSError, EOFError, ProtocolError) as e:
        raise SeedWeightsError("protocol", address=address, detail=str(e)[:200] or type(e).__name__) from None
    finally:
        if target is not None:
            target.abandon()
        sock.close()


def _quietly(fn, *args) -> None:
    try:
        fn(*args)
    except OSError:
        pass


# -- the rank's choice ---------------------------------------------------------------------------
def load_weights(daemon) -> None:
    """Seed this rank's weights if asked (see the module's docstring), else load them from disk."""
    spec, cfg = daemon.spec, daemon.cfg
    if not wanted(spec, cfg.model):
        daemon.load()
        return
    present = seeded_checkpoint.has_shards(cfg.model)
    address = spec["seed"]
    kind = resolve_transport(spec.get("transport", "auto"), cfg.torch_device)
    try:
        seeded = pull(address, spec.get("seed_token") or "", cfg, kind, present,
                      spec.get("seed_stall_s") or DEFAULT_STALL_S)
    except SeedWeightsError as e:
        if not present:
            raise UserError(SEED_WEIGHTS_FATAL.format(reason=e)) from None
        log.warning(SEED_WEIGHTS_FALLBACK.format(reason=e))
        daemon.load()
        log.info(WEIGHTS_FROM_DISK.format(rank=daemon.rank, why=f"seeding failed: {e.kind}"))
        return
    if not present:  # so that this rank's engines compute the same key without shards
        seeded_checkpoint.write(cfg.model, cache_root(), seeded.shards, address)
    # The daemons' world of a multi-node group (a no-op alone): the other ranks wait for this one
    # there, and every rank must hold the same checkpoint, seeded or read.
    join_daemon_world(spec.get("world"), cfg.ranks, cfg.device, seeded.key["checkpoint"])
    daemon.take_seeded(seeded)
    log.info(SEEDED_WEIGHTS.format(rank=daemon.rank, address=address, tensors=len(daemon.arena.layout.entries),
                                   mib=seeded.weights_bytes / 2**20, seconds=seeded.seconds, how=seeded.how,
                                   sent=seeded.sent))
    log.info(SEEDING_PHASES.format(rank=daemon.rank, phases=json.dumps(seeded.phases)))
