"""Helpers of the docker tier: run the examples as a reader would, read containers' logs and state."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # tools.docs_runner
sys.path.insert(0, str(ROOT / "tests"))

from tools.docs_runner.shell import logical_lines  # noqa: E402  (the docs runner reads bash as CI runs it)
from tools.docs_runner.substitutions import apply_substitutions, load_substitutions  # noqa: E402
from procs import free_port, http, wait_until  # noqa: E402,F401

IMAGE = "wcache:dockertest"
EXAMPLES = ROOT / "examples"
RUNS: list[tuple[str, float]] = []  # (what, seconds), printed in the terminal summary
COMPOSE_USED: str = ""


class SetupError(Exception):
    pass


def example(name: str) -> str:
    """An example file as CI runs it: with tools/substitutions.yaml applied (the GPU-only lines)."""
    return apply_substitutions((EXAMPLES / name).read_text(), load_substitutions())


def unique(prefix: str = "wct") -> str:
    return f"{prefix}{uuid.uuid4().hex[:8]}"


def docker(*args: str, check: bool = True, timeout: float = 120, input: str | None = None) -> subprocess.CompletedProcess:
    r = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout, input=input)
    if check and r.returncode != 0:
        raise AssertionError(f"docker {' '.join(args)} exited {r.returncode}:\n{r.stdout}\n{r.stderr}")
    return r


def logs(container: str) -> str:
    r = docker("logs", container, check=False)
    return r.stdout + r.stderr


def inspect(container: str) -> dict:
    return json.loads(docker("inspect", container).stdout)[0]


def remove(containers: list[str] = (), volumes: list[str] = ()) -> None:
    if containers:
        docker("rm", "-f", *containers, check=False, timeout=60)
    if volumes:
        docker("volume", "rm", "-f", *volumes, check=False, timeout=60)


def healthy(port: int) -> bool:
    try:
        return http("GET", f"http://127.0.0.1:{port}/health", timeout=2)[0] == 200
    except OSError:
        return False


def wait_log_count(container: str, text: str, count: int, timeout: float = 120) -> str:
    """Wait until ``text`` occurs ``count`` times in the container's log; return the log."""
    out = ""

    def seen() -> bool:
        nonlocal out
        out = logs(container)
        return out.count(text) >= count

    wait_until(seen, timeout, f"{count} x {text!r} in the log of {container}", lambda: out[-6000:])
    return out


def run_script(script: str, env: dict, timeout: float = 300, what: str = "script") -> subprocess.CompletedProcess:
    t0 = time.monotonic()
    r = subprocess.run(["bash", "-c", script], env={**os.environ, **env}, capture_output=True, text=True,
                       timeout=timeout)
    RUNS.append((what, time.monotonic() - t0))
    return r


def logical_line(script: str, startswith: str) -> str:
    """The one logical line (continuations joined) of ``script`` that starts with ``startswith``."""
    found = [ln.text for ln in logical_lines(script) if ln.text.lstrip().startswith(startswith)]
    assert len(found) == 1, f"expected one line starting with {startswith!r}, found {found}"
    return found[0].strip()


def variant(line: str, *edits: tuple[str, str]) -> str:
    """``line`` with each (old, new) replacement made exactly once: a change to the example that a
    variant relies on fails here instead of silently testing something else."""
    for old, new in edits:
        assert line.count(old) == 1, f"{old!r} occurs {line.count(old)} times in: {line}"
        line = line.replace(old, new)
    return line


def compose_command() -> list[str]:
    """`docker compose` (v2) when the CLI has it, else Debian's docker-compose (1.29)."""
    global COMPOSE_USED
    if subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0:
        COMPOSE_USED = "docker compose: " + docker("compose", "version").stdout.strip()
        return ["docker", "compose"]
    exe = shutil.which("docker-compose")
    assert exe, "no Compose implementation: tools/docker/install.sh installs docker-compose"
    COMPOSE_USED = subprocess.run([exe, "version", "--short"], capture_output=True, text=True).stdout.strip()
    COMPOSE_USED = f"docker-compose {COMPOSE_USED} (Debian)"
    return [exe]


def mapped_line() -> str:
    from wcache import errors

    return errors.MAPPED.format(count=27, mode="zero_copy")


def count_re(pattern: str, text: str) -> int:
    return len(re.findall(pattern, text))
