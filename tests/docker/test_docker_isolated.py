"""examples/docker-run-isolated.sh and examples/compose-isolated.yaml for real: no shared namespaces.

The daemon and the engine share two volumes (the socket directory and the cache root) and nothing
else: each container has its own PID, IPC and mount namespaces and its own /dev/shm. The engine
still maps the daemon's weights, maps them again after a restart, and maps them from a container
with its own network namespace as well; a restarted daemon takes the weights back from the running
engines (handback.py) instead of reading the checkpoint.

CPU CI runs the memfd transport: `--weight-cache-transport vmm_fd` and the loader's
`"transport": "vmm_fd"` are accepted and mean the memfd arena on a CPU, which crosses namespaces for
the same reason vmm_fd does (a file descriptor sent over the Unix socket). The vmm_fd GPU transport
across namespaces is measured on a GPU host (docs/benchmarks/*-ns-matrix-vmm_fd.json,
docs/gpu-transports.md). `--gpus all` and the Compose GPU request are removed by the declared
substitutions (tools/substitutions.yaml).
"""

from __future__ import annotations

import os
import subprocess

import pytest
import yaml
from dockerlib import (compose_command, docker, example, free_port, healthy, inspect, logical_line, logs, mapped_line,
                       remove, run_script, unique, variant, wait_log_count, wait_until)
from tools.docs_runner.shell import logical_lines
from procs import complete

pytestmark = [pytest.mark.docker, pytest.mark.slow]

MOUNTS = {"/run/wcache", "/var/cache/wcache", "/model"}  # the volumes, and the model (read-only)
ENGINE_LINE = 'docker run -d --name "$NAME-engine"'
SHM_PROBE = "/dev/shm/wcache-isolation-probe"
HEALTH_IN_CONTAINER = ("import sys, urllib.request; "
                       "print(urllib.request.urlopen('http://127.0.0.1:' + sys.argv[1] + '/health', timeout=3).status)")


def namespaces(container: str, kinds=("pid", "ipc", "mnt", "net")) -> dict[str, str]:
    """The namespaces of a process in ``container`` (docker exec joins all of them)."""
    out = docker("exec", container, "readlink", *[f"/proc/self/ns/{k}" for k in kinds]).stdout.split()
    return dict(zip(kinds, out))


def host_namespaces(kinds=("pid", "ipc", "mnt", "net")) -> dict[str, str]:
    return {k: os.readlink(f"/proc/self/ns/{k}") for k in kinds}


def assert_isolated(daemon: str, engine: str) -> None:
    """Own PID, IPC and mount namespaces and /dev/shm; only the volumes (and the model) are shared."""
    d, e = inspect(daemon), inspect(engine)
    for c in (d, e):
        assert c["HostConfig"]["IpcMode"] == "private", c["HostConfig"]["IpcMode"]
        assert c["HostConfig"]["PidMode"] == "", c["HostConfig"]["PidMode"]  # "" is a private PID namespace
        assert {m["Destination"] for m in c["Mounts"]} == MOUNTS, c["Mounts"]
    assert {m["Name"] for m in d["Mounts"] if m["Type"] == "volume"} == \
        {m["Name"] for m in e["Mounts"] if m["Type"] == "volume"}
    dn, en, hn = namespaces(daemon), namespaces(engine), host_namespaces()
    for kind in ("pid", "ipc", "mnt"):
        assert len({dn[kind], en[kind], hn[kind]}) == 3, (kind, dn, en, hn)
    # Each sees only its own processes: PID 1 is its own command.
    assert "wcache preload" in docker("exec", daemon, "cat", "/proc/1/cmdline").stdout.replace("\0", " ")
    assert "wcache serve" in docker("exec", engine, "cat", "/proc/1/cmdline").stdout.replace("\0", " ")
    # Each has its own /dev/shm: a file the daemon's container writes there, the engine's cannot see.
    docker("exec", daemon, "touch", SHM_PROBE)
    try:
        assert docker("exec", engine, "test", "-e", SHM_PROBE, check=False).returncode == 1
    finally:
        docker("exec", daemon, "rm", "-f", SHM_PROBE, check=False)


def assert_cpu_transport(daemon: str, engine: str) -> None:
    """What CI ran: the vmm_fd flag and key were accepted, and on the CPU they mean the memfd arena."""
    d, e = inspect(daemon), inspect(engine)
    assert "--weight-cache-transport" in " ".join(d["Args"]) and "vmm_fd" in " ".join(d["Args"]), d["Args"]
    assert any('"transport": "vmm_fd"' in a for a in e["Args"]), e["Args"]
    assert "into a memfd arena" in logs(daemon)


def test_docker_run_pair_maps_across_namespaces_and_again_after_a_restart(docker_image, docker_model):
    name = unique("wci")
    env = {"MODEL_DIR": str(docker_model), "IMAGE": docker_image, "PORT": str(free_port()),
           "HEALTH_PORT": str(free_port()), "NAME": name}
    script = example("docker-run-isolated.sh")
    runs = [ln.text for ln in logical_lines(script) if ln.text.lstrip().startswith("docker run")]
    assert len(runs) == 2 and not [r for r in runs if "--gpus" in r or "--ipc" in r or "--pid" in r or "shm" in r]
    daemon, engine, other = f"{name}-daemon", f"{name}-engine", f"{name}-engine-netns"
    port = int(env["PORT"])
    try:
        r = run_script(script, env, what="examples/docker-run-isolated.sh: daemon ready, engine started")
        assert r.returncode == 0, f"examples/docker-run-isolated.sh failed:\n{r.stdout}\n{r.stderr}\n{logs(daemon)}"
        wait_until(lambda: healthy(port), 120, "engine /health 200", lambda: logs(engine)[-6000:])
        log = logs(engine)
        assert mapped_line() in log and "falling back" not in log, log
        assert_isolated(daemon, engine)
        assert_cpu_transport(daemon, engine)
        answer = complete(port)["choices"][0]["token_ids"]

        # A restarted engine (new PID and IPC namespaces) maps the weights again; the daemon runs on.
        before = inspect(daemon)
        r = run_script(f"docker restart -t 10 {engine}", {}, what="isolated pair: docker restart engine")
        assert r.returncode == 0, r.stderr
        log = wait_log_count(engine, mapped_line(), 2)
        wait_until(lambda: healthy(port), 120, "restarted engine /health 200", lambda: logs(engine)[-6000:])
        after = inspect(daemon)
        assert after["State"]["Pid"] == before["State"]["Pid"] and after["RestartCount"] == 0
        assert "falling back" not in log
        assert_isolated(daemon, engine)
        assert complete(port)["choices"][0]["token_ids"] == answer

        # The network namespace is not needed either: the same engine line with --network none
        # (only a loopback of its own) maps the weights through the socket on the volume.
        netns_port = free_port()
        line = variant(logical_line(script, ENGINE_LINE), ('--name "$NAME-engine"', '--name "$NAME-engine-netns"'),
                       (" --restart always", ""), ("--network host", "--network none"))
        r = run_script(line, {**env, "PORT": str(netns_port)}, what="isolated engine with --network none")
        assert r.returncode == 0, r.stderr
        wait_log_count(other, mapped_line(), 1)

        def answers_inside() -> bool:
            probe = docker("exec", other, "python3", "-c", HEALTH_IN_CONTAINER, str(netns_port), check=False)
            return probe.stdout.strip() == "200"

        wait_until(answers_inside, 120, "--network none engine /health 200 (from inside)", lambda: logs(other)[-6000:])
        assert inspect(other)["HostConfig"]["NetworkMode"] == "none"
        assert namespaces(other)["net"] not in (namespaces(daemon)["net"], host_namespaces()["net"])
        assert not healthy(netns_port)  # not reachable from the host: a network namespace of its own

        # A restarted daemon takes the weights back from the running engines, across namespaces:
        # the memfd travels back over a socket on the volume, and nothing is read from disk.
        r = run_script(f"docker restart -t 10 {daemon}", {}, what="isolated pair: docker restart daemon (adopts)")
        assert r.returncode == 0, r.stderr
        adopted = wait_log_count(daemon, "adopted the arena of a running engine", 1)
        assert adopted.count("Rank 0 loaded 27 tensors") == 1, adopted  # the first start only
        for e in (engine, other):
            wait_log_count(e, "Leased the weights again from the restarted weight cache daemon", 1)
        assert complete(port)["choices"][0]["token_ids"] == answer
        assert "offers them to the next daemon" in logs(engine)
    finally:
        remove([other, engine, daemon], [f"{name}-sockets", f"{name}-cache"])


def test_compose_file_maps_across_namespaces_and_again_after_a_restart(docker_image, docker_model, tmp_path):
    compose = compose_command()
    path = tmp_path / "compose-isolated.yaml"
    path.write_text(example("compose-isolated.yaml"))
    services = yaml.safe_load(path.read_text())["services"]
    assert "nvidia" not in path.read_text()
    for s in services.values():
        assert not {"ipc", "pid", "shm_size"} & set(s) and not [v for v in s["volumes"] if "/dev/shm" in v], s
    port, health = free_port(), free_port()
    env = {"MODEL_DIR": str(docker_model), "WCACHE_IMAGE": docker_image, "PORT": str(port),
           "HEALTH_PORT": str(health)}
    cmd = " ".join([*compose, "-p", unique("wci"), "-f", str(path)])
    try:
        r = run_script(f"{cmd} up -d", env, what="compose-isolated.yaml: up -d (daemon healthy, engine started)")
        assert r.returncode == 0, r.stdout + r.stderr
        ids = {s: run_script(f"{cmd} ps -q {s}", env, what="compose-isolated.yaml: ps").stdout.strip()
               for s in ("weight-cache", "engine")}
        daemon, engine = ids["weight-cache"], ids["engine"]
        assert daemon and engine, ids
        wait_until(lambda: healthy(port), 120, "engine /health 200", lambda: logs(engine)[-6000:])
        log = logs(engine)
        assert mapped_line() in log and "falling back" not in log and "Waiting up to" not in log, log
        assert_isolated(daemon, engine)
        assert_cpu_transport(daemon, engine)
        started = inspect(daemon)["State"]["StartedAt"]

        r = run_script(f"{cmd} restart engine", env, what="compose-isolated.yaml: restart engine")
        assert r.returncode == 0, r.stdout + r.stderr
        wait_log_count(engine, mapped_line(), 2)
        wait_until(lambda: healthy(port), 120, "restarted engine /health 200")
        assert inspect(daemon)["State"]["StartedAt"] == started
        assert_isolated(daemon, engine)
        assert complete(port)["choices"][0]["token_ids"]
    finally:
        subprocess.run(f"{cmd} down -v --timeout 10", shell=True, env={**os.environ, **env},
                       capture_output=True, timeout=120)
