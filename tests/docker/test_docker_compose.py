"""examples/compose.yaml and examples/compose-scoped.yaml for real (GPU requests substituted away).

Each file comes up with one command; the engine must start only once the daemon's healthcheck
passes (so it maps the weights and never falls back), and a restarted engine maps them again
while the daemon keeps running.
"""

from __future__ import annotations

import os
import subprocess
from datetime import datetime

import pytest
from dockerlib import (compose_command, docker, example, free_port, healthy, inspect, logs, mapped_line,
                       run_script, unique, wait_log_count, wait_until)
from procs import complete

pytestmark = [pytest.mark.docker, pytest.mark.slow]


def _time(stamp: str) -> datetime:
    """Docker's RFC 3339 timestamps carry nanoseconds; datetime takes microseconds."""
    head, _, frac = stamp.rstrip("Z").partition(".")
    return datetime.fromisoformat(f"{head}.{(frac + '000000')[:6]}+00:00")


@pytest.mark.parametrize("file", ["compose.yaml", "compose-scoped.yaml"])
def test_compose_file(file, docker_image, docker_model, tmp_path):
    compose = compose_command()
    path = tmp_path / file
    path.write_text(example(file))
    assert "nvidia" not in path.read_text()
    port, health = free_port(), free_port()
    env = {"MODEL_DIR": str(docker_model), "WCACHE_IMAGE": docker_image, "PORT": str(port),
           "HEALTH_PORT": str(health)}
    cmd = " ".join([*compose, "-p", unique("wcc"), "-f", str(path)])
    try:
        r = run_script(f"{cmd} up -d", env, what=f"{file}: up -d (daemon healthy, engine started)")
        assert r.returncode == 0, r.stdout + r.stderr
        ids = {s: run_script(f"{cmd} ps -q {s}", env, what=f"{file}: ps").stdout.strip()
               for s in ("weight-cache", "engine")}
        daemon, engine = ids["weight-cache"], ids["engine"]
        assert daemon and engine, ids
        wait_until(lambda: healthy(port), 120, "engine /health 200", lambda: logs(engine)[-6000:])

        # depends_on: service_healthy: the engine container started after the daemon was READY,
        # so its first attempt found the socket: mapped, no fallback, no wait.
        stamped = docker("logs", "-t", daemon)
        ready_at = [ln.split(" ", 1)[0] for ln in (stamped.stdout + stamped.stderr).splitlines()
                    if "Weight cache daemon READY" in ln]
        d, e = inspect(daemon), inspect(engine)
        assert ready_at and _time(e["State"]["StartedAt"]) > _time(ready_at[0])
        assert d["State"]["Health"]["Status"] == "healthy"
        log = logs(engine)
        assert mapped_line() in log and "falling back" not in log and "Waiting up to" not in log, log

        if file == "compose-scoped.yaml":
            # The engine joined the daemon container's IPC and PID namespaces, and nothing else's.
            assert d["HostConfig"]["IpcMode"] == "shareable"
            assert e["HostConfig"]["IpcMode"] == e["HostConfig"]["PidMode"] == f"container:{d['Id']}"
            pid1 = docker("exec", engine, "cat", "/proc/1/cmdline").stdout.replace("\0", " ")
            assert "wcache preload" in pid1, pid1
        else:
            assert d["HostConfig"]["IpcMode"] == e["HostConfig"]["IpcMode"] == "host"
            assert d["HostConfig"]["PidMode"] == e["HostConfig"]["PidMode"] == "host"

        r = run_script(f"{cmd} restart engine", env, what=f"{file}: restart engine")
        assert r.returncode == 0, r.stdout + r.stderr
        wait_log_count(engine, mapped_line(), 2)
        wait_until(lambda: healthy(port), 120, "restarted engine /health 200")
        assert inspect(daemon)["State"]["StartedAt"] == d["State"]["StartedAt"]
        assert complete(port)["choices"][0]["token_ids"]
    finally:
        subprocess.run(f"{cmd} down -v --timeout 10", shell=True, env={**os.environ, **env},
                       capture_output=True, timeout=120)
