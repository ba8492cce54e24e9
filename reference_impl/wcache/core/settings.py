"""Typed settings from the command line: the one place where a parsed namespace becomes a dataclass.

The command line (cli/) is the only code that holds argparse's namespace. It turns it, once, into
the frozen settings dataclasses the layers below take (``ParallelSettings`` below,
``daemon.seed_settings.SeedSettings``, ``daemon.launcher.PreloadSettings``, ``engine.core.settings.
EngineSettings`` and ``CoreSettings``, ``engine.api_server.settings.ServeSettings``,
``bench.settings.BenchSettings``). A process started with settings (the engine core, a ``--respawn``
supervisor or worker) gets them as data (``to_data``: JSON or msgpack, never pickle) and checks them
again on its side (``from_data``). A field is named after the
flag's destination (``--weight-cache-seed-token`` -> ``weight_cache_seed_token``), so a new flag
reaches the code by adding a field of its name; a field whose flag a command does not have keeps its
default (``wcache serve`` has no ``--weight-cache-master-port``). A field whose type is itself a
settings dataclass is built from the same namespace. The checks that need more than the flags (the
model's config, the devices) stay in the code that plans with them, which raises the user's error.
"""

from __future__ import annotations

import dataclasses
import typing

import msgspec

from wcache.core.flag_defaults import DEFAULT_MASTER_ADDR, DEFAULT_MASTER_PORT

T = typing.TypeVar("T")


def from_flags(cls: type[T], flags: object) -> T:
    """``cls`` (a settings dataclass) from a parsed command line: each field from the attribute of
    its name, else its default; a nested settings dataclass from the same ``flags``."""
    hints = typing.get_type_hints(cls)
    values = {}
    for field in dataclasses.fields(cls):
        kind = hints[field.name]
        if dataclasses.is_dataclass(kind):
            values[field.name] = from_flags(kind, flags)
        elif hasattr(flags, field.name):
            value = getattr(flags, field.name)
            # argparse's nargs="+" gives a list: a frozen settings object holds a tuple.
            values[field.name] = tuple(value) if isinstance(value, list) else value
    return cls(**values)


def to_data(settings) -> dict:
    """``settings`` as plain data (dicts, lists, strings, numbers) for another process."""
    return msgspec.to_builtins(settings)


def from_data(cls: type[T], data: object) -> T:
    """``cls`` from what ``to_data`` gave, checked again: every field's type (msgspec), and no key
    that is no field (another version's settings, or a misspelt one, would otherwise pass silently)."""
    unknown = _unknown_keys(cls, data, "$")
    if unknown:
        raise ValueError(f"{cls.__name__}: no such setting(s): {', '.join(unknown)}")
    try:
        return msgspec.convert(data, cls)
    except msgspec.ValidationError as e:
        raise ValueError(f"{cls.__name__}: {e}") from None


def _unknown_keys(cls, data, where: str) -> list[str]:
    if not isinstance(data, dict):
        return []  # msgspec names the wrong type
    hints = typing.get_type_hints(cls)
    out = [f"{where}.{k}" for k in data if k not in hints]
    for field in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[field.name]) and field.name in data:
            out += _unknown_keys(hints[field.name], data[field.name], f"{where}.{field.name}")
    return out


@dataclasses.dataclass(frozen=True)
class ModelSettings:
    """The flags that say which weights and how (add_model_args' part that `wcache preload` and
    `wcache serve` share): the daemon and the engine read the same ones, for the same cache key."""

    model: str
    dtype: str = "auto"
    quantization: str | None = None
    device: str = "auto"
    revision: str | None = None
    load_format: str = "auto"
    enable_autotune: bool = True


@dataclasses.dataclass(frozen=True)
class ParallelSettings:
    """The parallel flags of `wcache serve` and `wcache preload` (add_parallel_args in cli/flags.py),
    plus each command's own: the engine's --data-parallel-rank, the daemons' rendezvous ports.
    Checked against each other and the model by core/ranks.py's plan_layout, plan_engine and
    plan_daemons. Here, with no torch, so the engine's front process can hold `wcache serve`'s settings."""

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    data_parallel_size_local: int | None = None
    data_parallel_start_rank: int | None = None
    data_parallel_address: str | None = None
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = DEFAULT_MASTER_ADDR
    master_port: int = DEFAULT_MASTER_PORT
    speculative_config: str | None = None  # the flag's JSON text (core/speculative.py parses it)
    data_parallel_rank: int | None = None  # wcache serve only
    weight_cache_master_port: int | None = None  # wcache preload only
    weight_cache_draft_master_port: int | None = None  # wcache preload only
