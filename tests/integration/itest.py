"""Helpers for the integration tests (imported as `itest`; fixtures stay in conftest.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from procs import alive, call, child_pids, wait_until  # noqa: F401  (re-exported: liveness, the raw protocol client and the poll)
from wcache.core.device import device_identity
from wcache.wire.sockets import socket_name

HERE = Path(__file__).parent


def default_socket(env: dict) -> Path:
    return Path(env["TMPDIR"]) / f"wcache_{os.getuid()}" / socket_name(device_identity("cpu", 0))


def rank_pids(launcher_pid: int) -> list[int]:
    """The daemon rank processes a `wcache preload` launcher started (its children)."""
    return child_pids(launcher_pid)


def memfd_inode(pid: int) -> int:
    """The inode of the arena memfd a daemon rank holds: the same inode is the same memory."""
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            if "memfd:wcache-arena" in os.readlink(f"/proc/{pid}/fd/{fd}"):
                return os.stat(f"/proc/{pid}/fd/{fd}").st_ino
        except OSError:
            continue
    raise AssertionError(f"pid {pid} holds no arena memfd")


def run_cli(*args: str, env: dict, timeout: float = 120.0) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "wcache.cli", *args], check=False, env=env, capture_output=True, text=True,
                          timeout=timeout)


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
