"""Helpers for the integration tests (imported as `itest`; fixtures stay in conftest.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from procs import call, child_pids  # noqa: F401  (call is re-exported: the raw protocol client)
from wcache.core.device import device_identity
from wcache.wire.sockets import socket_name

HERE = Path(__file__).parent


def default_socket(env: dict) -> Path:
    return Path(env["TMPDIR"]) / f"wcache_{os.getuid()}" / socket_name(device_identity("cpu", 0))


def rank_pids(launcher_pid: int) -> list[int]:
    """The daemon rank processes a `wcache preload` launcher started (its children)."""
    return child_pids(launcher_pid)


def run_cli(*args: str, env: dict, timeout: float = 120.0) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "wcache.cli", *args], check=False, env=env, capture_output=True, text=True,
                          timeout=timeout)


def wait_until(predicate, timeout: float = 30.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.05)


def fallback_reason(cfg, caplog, **loader) -> str:
    """Load with the ipc_cache loader, expect a disk fallback, and return its logged reason."""
    import logging

    from wcache.engine.loading.registry import load_weights
    from wcache.engine.loading.config import LoaderConfig

    caplog.set_level(logging.INFO, "wcache.engine.loader")
    _, report, _lease = load_weights(cfg, "ipc_cache", LoaderConfig(**loader))
    assert report.source == "disk", "the engine should have loaded from disk"
    assert f"Weight cache unusable ({report.fallback_reason}); falling back to disk loading" in caplog.text
    return report.fallback_reason
