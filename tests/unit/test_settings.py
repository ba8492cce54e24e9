"""The typed settings each command builds from its parsed command line (core/settings.py's from_flags).

A settings field is filled from the flag of its name, and keeps its default when the command has no
such flag; so a field whose name is no flag of its command would be silently ignored. These tests
hold every field to a flag of the real parser, and every default to the flag's default.
"""

from __future__ import annotations

import dataclasses
import typing

import pytest
from wcache.bench.settings import BenchSettings
from wcache.cli import build_parser
from wcache.core.settings import from_data, from_flags, to_data
from wcache.daemon.launcher import PreloadSettings
from wcache.engine.api_server.settings import ServeSettings
from wcache.engine.core.settings import CoreSettings, EngineSettings

# The fields of ParallelSettings that only the other command has (core/ranks.py says which).
SERVE_ONLY = {"data_parallel_rank"}
PRELOAD_ONLY = {"weight_cache_master_port", "weight_cache_draft_master_port"}
COMMANDS = [  # (settings class, its command's argv with only what is required, fields the command lacks)
    (PreloadSettings, ["preload", "--model", "m"], SERVE_ONLY),
    (EngineSettings, ["serve", "m"], PRELOAD_ONLY),
    (BenchSettings, ["bench", "--model", "m"], set()),
    (ServeSettings, ["serve", "m"], PRELOAD_ONLY),
]


def defaults(cls):
    """``cls`` as code would build it for model ``m`` with no other setting."""
    if cls is ServeSettings:
        return ServeSettings(CoreSettings(EngineSettings(model="m")))
    return cls(model="m")


def leaf_fields(cls) -> set[str]:
    """Every field name of ``cls`` and of the settings dataclasses nested in it."""
    out, hints = set(), typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        out |= leaf_fields(hints[f.name]) if dataclasses.is_dataclass(hints[f.name]) else {f.name}
    return out


def unknown_fields(cls, argv: list[str], lacking: set[str]) -> set[str]:
    dests = set(vars(build_parser().parse_args(argv)))
    return leaf_fields(cls) - dests - lacking


@pytest.mark.parametrize("cls, argv, lacking", COMMANDS, ids=[c.__name__ for c, *_ in COMMANDS])
def test_every_field_is_a_flag_of_its_command(cls, argv, lacking):
    assert unknown_fields(cls, argv, lacking) == set()


@pytest.mark.parametrize("cls, argv, lacking", COMMANDS, ids=[c.__name__ for c, *_ in COMMANDS])
def test_every_default_is_the_flags_default(cls, argv, lacking):
    # Code that builds settings itself (a test, a bench) gets what the command line gives.
    assert from_flags(cls, build_parser().parse_args(argv)) == defaults(cls)


def test_flags_reach_nested_settings_and_the_settings_are_frozen():
    args = build_parser().parse_args(["preload", "--model", "m", "-tp", "2", "--weight-cache-seed", "h:1",
                                      "--weight-cache-master-port", "29600", "--no-weight-cache-adopt"])
    s = from_flags(PreloadSettings, args)
    assert (s.parallel.tensor_parallel_size, s.parallel.weight_cache_master_port) == (2, 29600)
    assert s.seeding.weight_cache_seed == "h:1" and s.weight_cache_adopt is False
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.model = "other"
    serve = from_flags(EngineSettings, build_parser().parse_args(["serve", "m", "--data-parallel-rank", "1"]))
    assert serve.parallel.data_parallel_rank == 1 and serve.parallel.weight_cache_master_port is None


def test_a_field_named_after_no_flag_is_found():
    """The negative control: a misspelt field would keep its default whatever the flag says."""

    @dataclasses.dataclass(frozen=True)
    class Misspelt:
        model: str
        tensor_paralel_size: int = 1

    assert unknown_fields(Misspelt, ["serve", "m"], set()) == {"tensor_paralel_size"}


def serve_settings(argv: list[str]) -> ServeSettings:
    args = build_parser().parse_args(argv)
    args.model = args.model or args.model_flag  # cli.resolve_model's part
    return from_flags(ServeSettings, args)


def test_serve_settings_reach_a_child_process_as_data_and_back():
    """What the front sends its engine core, and --respawn its supervisor and workers (as JSON or
    msgpack, never pickle), comes back equal, and the child checks it again: a wrong type or a key
    that is no setting is refused with what and where."""
    import json

    import msgspec

    s = serve_settings(["serve", "m", "--api-key", "k1", "k2", "--served-model-name", "a", "b", "-tp", "2",
                        "--respawn", "--port", "8123", "--shutdown-delay", "0", "--cpu-memory-capacity", "1GiB"])
    assert (s.api.api_key, s.api.served_model_name) == (("k1", "k2"), ("a", "b"))
    assert s.engine.parallel.tensor_parallel_size == 2 and s.engine.cpu_memory_capacity == 1 << 30
    assert (s.core.respawn, s.http.port, s.http.shutdown_delay) == (True, 8123, 0.0)
    assert from_data(ServeSettings, json.loads(json.dumps(to_data(s)))) == s
    assert from_data(CoreSettings, msgspec.msgpack.decode(msgspec.msgpack.encode(to_data(s.core)))) == s.core
    assert "k1" not in json.dumps(to_data(s.core))  # the engine core is never told the API key
    assert "k1" not in repr(s)  # nor is it in a log line of the settings
    data = to_data(s)
    data["http"]["port"] = "8123"
    with pytest.raises(ValueError, match=r"ServeSettings: Expected `int`, got `str` - at `\$.http.port`"):
        from_data(ServeSettings, data)
    data = to_data(s.core)
    data["engine"]["parallel"]["tensor_paralel_size"] = 2
    with pytest.raises(ValueError, match=r"CoreSettings: no such setting\(s\): \$.engine.parallel.tensor_paralel_size"):
        from_data(CoreSettings, data)
