"""The ``ipc_cache`` loader's settings: the keys of ``--model-loader-extra-config``, validated."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields

from wcache.errors import LoaderConfigError
from wcache.wire.transports.auto import TRANSPORTS

MODES = ("zero_copy", "copy")
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
