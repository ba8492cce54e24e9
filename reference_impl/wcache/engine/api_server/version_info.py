"""``GET /version``: what is running, as an operator asks before and after a rollout.

vLLM's ``/version`` answers ``{"version": ...}``; this adds what a weight cache's engine is made of:
the commit when it runs from a git checkout (``git describe``; ``null`` when installed from a
package, where no checkout says it), the torch it runs on, and the device it serves from (``null``
while the weights load).
"""

from __future__ import annotations

import subprocess
from functools import lru_cache
from pathlib import Path

import wcache


@lru_cache(maxsize=1)
def commit() -> str | None:
    """``git describe --always --dirty`` of the checkout this package is imported from, else None."""
    root = Path(wcache.__file__).resolve().parents[2]
    if not (root / ".git").exists():
        return None
    try:
        out = subprocess.run(["git", "-C", str(root), "describe", "--always", "--dirty", "--tags"],
                             capture_output=True, text=True, timeout=5, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def version_body(device: str | None) -> dict:
    import torch

    return {"version": wcache.__version__, "commit": commit(), "torch": torch.__version__, "device": device}
