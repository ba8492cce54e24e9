"""`wcache preload`'s seeding flags, checked before any rank starts (daemon/seed.py serves and pulls).

Standard library only: the launcher validates these and imports no torch, which only its ranks
need (each replica of a fan-out paid about 2 s of CPU for that import on a 2-core host).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from wcache.errors import SeedConfigError

MIN_TOKEN_CHARS = 16
TOKEN_ENV = "WCACHE_SEED_TOKEN"
MAX_ROUND = 15  # replicas per round: the seed listener serves 16 connections at a time (seed.MAX_CONNECTIONS)


def parse_address(value: str, flag: str) -> tuple[str, int]:
    host, sep, port = str(value).strip().rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise SeedConfigError(SeedConfigError.BAD_ADDRESS.format(flag=flag, value=value))
    return host, int(port)


@dataclass(frozen=True)
class SeedSettings:
    """`wcache preload`'s seeding flags (add_preload_args in cli/flags.py), as given."""

    weight_cache_seed_listen: str | None = None
    weight_cache_seed_token: str | None = None
    weight_cache_seed: str | None = None
    weight_cache_seed_weights: str = "auto"
    weight_cache_seed_round_window: float | None = None
    weight_cache_seed_round_replicas: int | None = None
    weight_cache_seed_stall_timeout: float | None = None


def preload_seed_settings(s: SeedSettings) -> dict:
    """The seeding part of a rank spec from `wcache preload` flags, validated before any rank starts."""
    token = s.weight_cache_seed_token or os.environ.get(TOKEN_ENV) or None
    listen = seeds = None
    if s.weight_cache_seed_listen:
        if not token:
            raise SeedConfigError(SeedConfigError.LISTEN_WITHOUT_TOKEN)
        listen = parse_address(s.weight_cache_seed_listen, "--weight-cache-seed-listen")
    if s.weight_cache_seed:
        if not token:
            raise SeedConfigError(SeedConfigError.SEED_WITHOUT_TOKEN)
        seeds = [f"{h}:{p}" for h, p in (parse_address(a, "--weight-cache-seed")
                                         for a in s.weight_cache_seed.split(",") if a.strip())]
    if token is not None and len(token) < MIN_TOKEN_CHARS:
        raise SeedConfigError(SeedConfigError.SHORT_TOKEN.format(min=MIN_TOKEN_CHARS))
    window, stall = s.weight_cache_seed_round_window, s.weight_cache_seed_stall_timeout
    for flag, value in (("--weight-cache-seed-round-window", window), ("--weight-cache-seed-stall-timeout", stall)):
        if value is not None and not 0 <= value <= 3600:  # also NaN
            raise SeedConfigError(SeedConfigError.BAD_SECONDS.format(flag=flag, value=value))
    expect = s.weight_cache_seed_round_replicas
    if expect is not None and not 1 <= expect <= MAX_ROUND:
        raise SeedConfigError(SeedConfigError.BAD_ROUND_REPLICAS.format(value=expect, max=MAX_ROUND))
    return {"seed_listen": list(listen) if listen else None, "seed_token": token, "seeds": seeds,
            "seed_weights": s.weight_cache_seed_weights or "auto", "seed_window_s": window,
            "seed_round_replicas": expect, "seed_stall_s": stall}
