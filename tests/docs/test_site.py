"""The site builds with `mkdocs build --strict` and without a single warning."""

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ANSI = re.compile(r"\x1b\[[0-9;]*m")


def test_mkdocs_build_strict(tmp_path: Path) -> None:
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "mkdocs",
            "build",
            "--strict",
            "-f",
            "mkdocs.yml",
            "-d",
            str(tmp_path / "site"),
        ],
        cwd=ROOT,  # pymdownx.snippets resolves base_path "." against the working directory
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    output = ANSI.sub("", proc.stdout + proc.stderr)
    warnings = [line for line in output.splitlines() if re.match(r"\s*(WARNING|ERROR)\b", line)]
    assert proc.returncode == 0, output
    assert not warnings, "\n".join(warnings)
    assert (tmp_path / "site" / "index.html").is_file()
