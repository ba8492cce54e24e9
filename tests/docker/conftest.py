"""The docker tier: a real Docker engine, the image built from examples/Dockerfile, the examples run.

It installs and starts what it needs (tools/docker/*.sh): the engine from Debian's packages,
dockerd without a bridge (every container uses --network host, so traffic stays on loopback), a
base image bootstrapped from Debian packages, and the wcache image. Without root, or with
WCACHE_DOCKER=0, the tier is skipped with the reason printed. When the engine cannot be installed
or started, it is skipped too, except under CI=true, where that is a failure: CI must run it.
"""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # dockerlib

import dockerlib  # noqa: E402
import parallel  # noqa: E402

ROOT = dockerlib.ROOT
LOCK = Path("/var/lock/wcache-docker.lock")
TIMINGS: list[tuple[str, float]] = []


def _step(name: str, argv: list[str], env: dict | None = None, timeout: float = 900) -> str:
    t0 = time.monotonic()
    r = subprocess.run(argv, cwd=ROOT, env={**os.environ, **(env or {})}, stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, text=True, timeout=timeout)
    TIMINGS.append((name, time.monotonic() - t0))
    if r.returncode != 0:
        raise dockerlib.SetupError(f"{name} failed ({' '.join(argv)}, exit {r.returncode}):\n{r.stdout[-4000:]}")
    return r.stdout


def _unavailable(reason: str):
    if os.environ.get("CI") == "true":
        pytest.fail(f"docker tier: {reason} (CI=true: CI must run this tier)", pytrace=False)
    pytest.skip(f"docker tier: {reason}")


@pytest.fixture(scope="session")
def docker_image(request) -> str:
    """The tag of the wcache image, built from examples/Dockerfile on a running Docker engine."""
    if os.environ.get("WCACHE_DOCKER") == "0":
        pytest.skip("docker tier: WCACHE_DOCKER=0")
    if os.geteuid() != 0:
        pytest.skip("docker tier: needs root (installs Docker from Debian packages and starts dockerd)")
    LOCK.parent.mkdir(parents=True, exist_ok=True)
    with LOCK.open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one setup at a time on this machine
        try:
            _step("install (apt, if missing)", ["bash", "tools/docker/install.sh"])
            pid = _step("start dockerd (if not running)", ["bash", "tools/docker/start-dockerd.sh"]).strip()
        except (dockerlib.SetupError, subprocess.TimeoutExpired) as e:
            _unavailable(f"no Docker engine could be installed or started: {e}")
        if pid:
            request.addfinalizer(lambda: _stop_dockerd(int(pid.splitlines()[-1])))
        _step("base image (debootstrap + import, cached)", ["bash", "tools/docker/build-base.sh"])
        _step("wcache image (examples/Dockerfile)", ["bash", "tools/docker/build-image.sh"],
              env={"IMAGE": dockerlib.IMAGE, "PYTHON": sys.executable})
    return dockerlib.IMAGE


def _stop_dockerd(pid: int) -> None:
    """Stop the dockerd this session started, unless someone else's containers still run on it."""
    others = subprocess.run(["docker", "ps", "-q"], capture_output=True, text=True).stdout.split()
    if others:
        print(f"\ndocker tier: leaving dockerd (pid {pid}) running: {len(others)} container(s) still run on it")
        return
    t0 = time.monotonic()
    try:
        os.kill(pid, 15)
    except ProcessLookupError:
        return
    while time.monotonic() - t0 < 30:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.2)
    TIMINGS.append(("stop dockerd", time.monotonic() - t0))


@pytest.fixture(scope="session")
def docker_model(tmp_path_factory) -> Path:
    """The tiny checkpoint, readable by any user (a container may run as another uid)."""
    from wcache.core.checkpoint import make_checkpoint

    d = make_checkpoint(tmp_path_factory.mktemp("docker-model") / "tiny", "tiny")
    for p in [d, *d.iterdir()]:
        p.chmod(0o755 if p.is_dir() else 0o644)
    return d


def pytest_terminal_summary(terminalreporter):
    lines = [f"{secs:7.1f} s  {name}" for name, secs in TIMINGS + dockerlib.RUNS]
    if lines and dockerlib.COMPOSE_USED:
        lines.append(f"compose implementation: {dockerlib.COMPOSE_USED}")
    parallel.section(terminalreporter, "docker tier: timings", lines)
