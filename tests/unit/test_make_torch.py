"""`make demo` on a fresh machine installs PyTorch's CPU build, not the CUDA build the plain pin gets
from the default index, and a machine that cannot reach PyTorch's index falls back quickly ([truth-3])."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def venv_recipe(tmp_path: Path) -> str:
    """The commands `make` would run to create a virtualenv (-n: printed, not run)."""
    venv = tmp_path / "v"
    out = subprocess.run(["make", "-n", "-B", f"VENV={venv}", f"{venv}/.installed"], cwd=ROOT, capture_output=True,
                         text=True, check=True, timeout=60)
    return out.stdout.replace("\\\n", " ")  # a recipe line continued with a backslash is one command


def test_torch_comes_from_pytorchs_cpu_index_with_a_quick_fallback(tmp_path):
    plan = venv_recipe(tmp_path)
    line = next(l for l in plan.splitlines() if "torch==" in l)
    first, _, fallback = line.partition("||")
    # The CPU build first, one try, at most 5 s: CI machines without the internet must not wait.
    assert f"--index-url {CPU_INDEX}" in first and "--timeout 5" in first and "--retries 0" in first, line
    pin = re.search(r"torch==[\d.]+", first).group(0)
    # Then the same pin from the default index (and pip's configured mirrors), saying why.
    assert "unreachable" in fallback and re.search(rf"pip install -q {re.escape(pin)}\b", fallback), line
    assert "--index-url" not in fallback, line


def test_the_readme_says_where_torch_comes_from():
    readme = " ".join((ROOT / "README.md").read_text(encoding="utf-8").split())
    assert CPU_INDEX in readme and "cannot be reached" in readme and "CUDA build" in readme
