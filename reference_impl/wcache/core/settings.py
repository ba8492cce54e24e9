"""Typed settings from the command line: the one place where a parsed namespace becomes a dataclass.

The command line (cli/) and the launchers' entry points (the ``--respawn`` supervisor and its spare,
which get the flags back from a JSON spec) are the only code that holds argparse's namespace. Each
turns it, once, into the frozen settings dataclasses the layers below take (``core.ranks.
ParallelSettings``, ``daemon.seed_settings.SeedSettings``, ``daemon.launcher.PreloadSettings``,
``engine.settings.EngineSettings``, ``bench.settings.BenchSettings``). A field is named after the
flag's destination (``--weight-cache-seed-token`` -> ``weight_cache_seed_token``), so a new flag
reaches the code by adding a field of its name; a field whose flag a command does not have keeps its
default (``wcache serve`` has no ``--weight-cache-master-port``). A field whose type is itself a
settings dataclass is built from the same namespace. The checks that need more than the flags (the
model's config, the devices) stay in the code that plans with them, which raises the user's error.
"""

from __future__ import annotations

import dataclasses
import typing

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
