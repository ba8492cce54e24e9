"""The facts of the machine and the code a bench record measured, the same in every record."""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
from pathlib import Path

import torch

from wcache import __version__


def environment(device: str) -> dict:
    env = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "host": platform.node(), "python": platform.python_version(), "torch": torch.__version__,
           "wcache": __version__, "device": device, "cpu_count": os.cpu_count()}
    if device == "cuda":
        env["gpu"] = torch.cuda.get_device_name(0)
        try:
            env["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                           capture_output=True, text=True, timeout=20).stdout.strip().splitlines()[0]
        except (OSError, IndexError, subprocess.SubprocessError):
            env["driver"] = "unknown"
        env["cuda"] = torch.version.cuda
    commit = os.environ.get("WCACHE_COMMIT") or _git_commit()
    if commit:
        env["commit"] = commit  # the code the record measured (the guide labels records with it)
    return env


def _git_commit() -> str | None:
    """The checkout's short commit, where the package runs from one (a copied tree has none)."""
    try:
        out = subprocess.run(["git", "-C", str(Path(__file__).parent), "rev-parse", "--short", "HEAD"],
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None
