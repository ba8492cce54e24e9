"""examples/docker-run.sh for real: the daemon and the engine in two containers of one image.

The pair runs as the guide shows it (with tools/substitutions.yaml applied: no `--gpus all` on
CPU). Then each requirement of the engine's `docker run` is proven by its failure: the same line
without the shared socket volume, as another user, and without the shared cache volume.
"""

from __future__ import annotations

import os
import re
import signal
from dataclasses import dataclass, field

import pytest
from dockerlib import (docker, example, free_port, healthy, inspect, logical_line, logs, mapped_line, remove,
                       run_script, unique, variant, wait_log_count, wait_until)
from procs import complete

from wcache import errors
from wcache.core import autotune  # the project's own: an import error fails the module, never skips it

pytestmark = [pytest.mark.docker, pytest.mark.slow]

SOCKET_DIR = "/run/wcache/sockets"
IMAGE_UID = 10001  # examples/Dockerfile's WCACHE_UID
ENGINE_LINE = 'docker run -d --name "$NAME-engine"'


@dataclass
class Pair:
    name: str
    env: dict
    script: str
    extra: list[str] = field(default_factory=list)  # variant containers, removed at the end

    @property
    def daemon(self) -> str:
        return f"{self.name}-daemon"

    @property
    def engine(self) -> str:
        return f"{self.name}-engine"

    @property
    def port(self) -> int:
        return int(self.env["PORT"])

    def engine_line(self) -> str:
        return logical_line(self.script, ENGINE_LINE)

    def run_variant(self, suffix: str, *edits: tuple[str, str], detach: bool = True, timeout: float = 120):
        """The example's engine `docker run` line with ``edits``, as container <name>-engine-<suffix>
        on its own port, without the restart policy; returns (container, port, completed process)."""
        port = free_port()
        line = variant(self.engine_line(), ('--name "$NAME-engine"', f'--name "$NAME-engine-{suffix}"'),
                       (" --restart always", ""), *edits)
        if not detach:
            line = variant(line, ("docker run -d ", "docker run "))
        container = f"{self.name}-engine-{suffix}"
        self.extra.append(container)
        r = run_script(line, {**self.env, "PORT": str(port)}, timeout=timeout, what=f"engine variant: {suffix}")
        return container, port, r


@pytest.fixture(scope="module")
def pair(docker_image, docker_model):
    name = unique()
    env = {"MODEL_DIR": str(docker_model), "IMAGE": docker_image, "PORT": str(free_port()),
           "HEALTH_PORT": str(free_port()), "NAME": name}
    p = Pair(name, env, example("docker-run.sh"))
    assert "--gpus" not in p.script
    try:
        r = run_script(p.script, env, what="examples/docker-run.sh: daemon ready, engine started")
        assert r.returncode == 0, f"examples/docker-run.sh failed:\n{r.stdout}\n{r.stderr}\n{logs(p.daemon)}"
        wait_until(lambda: healthy(p.port), 120, "engine /health 200", lambda: logs(p.engine)[-6000:])
        yield p
    finally:
        remove([*p.extra, p.engine, p.daemon], [f"{name}-sockets", f"{name}-cache"])


def test_engine_maps_the_daemons_weights(pair):
    daemon_log, engine_log = logs(pair.daemon), logs(pair.engine)
    assert "Weight cache daemon READY" in daemon_log
    assert f"{SOCKET_DIR}/wcache_weight_cache_" in daemon_log
    assert mapped_line() in engine_log, engine_log
    assert "falling back" not in engine_log
    assert complete(pair.port)["choices"][0]["token_ids"]


def test_the_images_health_check_asks_each_containers_own_port(pair):
    # HEALTHCHECK asks WCACHE_HEALTH_URL, which each `docker run` line sets to its own port.
    for c in (pair.daemon, pair.engine):
        wait_until(lambda: inspect(c)["State"]["Health"]["Status"] == "healthy", 90, f"{c} healthy",
                   lambda: str(inspect(c)["State"].get("Health"))[-3000:])


def test_socket_dir_is_private_to_the_daemons_user(pair):
    # The daemon created the subdirectory of the named volume itself: 0700, owned by its uid.
    r = docker("exec", pair.daemon, "stat", "-c", "%a %u", SOCKET_DIR)
    assert r.stdout.split() == ["700", str(IMAGE_UID)]
    # Not root: both containers run as the image's user.
    for c in (pair.daemon, pair.engine):
        assert docker("exec", c, "id", "-u").stdout.strip() == str(IMAGE_UID)


def test_crashed_engine_is_restarted_and_maps_again(pair):
    before_d, before_e = inspect(pair.daemon), inspect(pair.engine)
    os.kill(before_e["State"]["Pid"], signal.SIGKILL)  # a crash: --restart always brings it back
    log = wait_log_count(pair.engine, mapped_line(), 2)
    wait_until(lambda: healthy(pair.port), 120, "restarted engine /health 200")
    after_d, after_e = inspect(pair.daemon), inspect(pair.engine)
    assert after_e["RestartCount"] >= 1 and after_e["State"]["Pid"] != before_e["State"]["Pid"]
    assert after_d["State"]["Pid"] == before_d["State"]["Pid"]
    assert after_d["State"]["StartedAt"] == before_d["State"]["StartedAt"] and after_d["RestartCount"] == 0
    second = log[log.index(mapped_line()) + 1:]
    assert "falling back" not in second
    assert complete(pair.port)["choices"][0]["token_ids"]


def test_a_crashed_daemon_is_restarted_and_takes_the_weights_back_from_the_engine(pair):
    """--restart always on the daemon too: Docker brings it back after a crash, and it adopts the
    running engine's arena (its state directory is on the cache volume) instead of reading the disk."""
    before = inspect(pair.daemon)
    assert before["HostConfig"]["RestartPolicy"]["Name"] == inspect(pair.engine)["HostConfig"]["RestartPolicy"]["Name"] == "always"
    os.kill(before["State"]["Pid"], signal.SIGKILL)
    log = wait_log_count(pair.daemon, "Weight cache daemon READY", 2)
    after = inspect(pair.daemon)
    assert after["RestartCount"] >= 1 and after["State"]["Pid"] != before["State"]["Pid"]
    assert "adopted the arena of a running engine" in log, log
    assert log.count("Rank 0 loaded 27 tensors") == 1, log  # the first start only
    wait_log_count(pair.engine, "Leased the weights again from the restarted weight cache daemon", 1)
    assert complete(pair.port)["choices"][0]["token_ids"]


def test_without_the_socket_volume_the_engine_falls_back_to_disk(pair):
    # The example turns fallback off; this variant turns it on, to show what it would do.
    container, port, r = pair.run_variant("nosock", ('-v "$NAME-sockets:/run/wcache" ', ""),
                                          ('"fallback": false', '"fallback": true'))
    assert r.returncode == 0, r.stderr
    wait_until(lambda: healthy(port), 120, "fallback engine /health 200", lambda: logs(container)[-6000:])
    log = logs(container)
    reason = errors.REASONS["no_socket"].format(path=f"{SOCKET_DIR}/wcache_weight_cache_")
    assert errors.FALLBACK.split("{reason}")[0] + reason in log, log
    assert mapped_line() not in log
    # A second copy of the weights, read from disk, gives the same answers.
    prompt = "The weight cache"
    assert complete(port, prompt)["choices"][0]["token_ids"] == complete(pair.port, prompt)["choices"][0]["token_ids"]


def test_without_the_socket_volume_and_no_fallback_the_engine_waits_then_fails(pair):
    # The example as it is (fallback off), with a short wait.
    _, _, r = pair.run_variant(
        "nosock-wait", ('-v "$NAME-sockets:/run/wcache" ', ""),
        ('"fallback": false', '"fallback": false, "state_timeout_s": 3'), detach=False)
    out = r.stdout + r.stderr
    assert r.returncode == 2, out
    assert errors.WAITING.format(timeout=3.0) in out
    reason = errors.REASONS["no_socket"].format(path=f"{SOCKET_DIR}/wcache_weight_cache_")
    assert errors.WeightCacheTimeoutError.TEMPLATE.format(timeout=3.0, reason=reason) in out, out


def test_an_engine_of_another_user_is_rejected(pair):
    # Same image, same volumes, another uid: the socket directory (0700) is not its own. (Were it
    # reachable, the daemon would still refuse the connection: it checks the peer's uid, SO_PEERCRED.)
    _, _, r = pair.run_variant("uid1000", ("docker run -d ", "docker run -d --user 1000 "), detach=False)
    out = r.stdout + r.stderr
    assert r.returncode == 2, out
    assert errors.SocketSecurityError.NOT_OWNED_DIR.format(dir=SOCKET_DIR) in out, out
    assert mapped_line() not in out and "falling back" not in out


def test_without_the_cache_volume_the_engine_tunes_again(pair):
    trials = re.escape(autotune.TRIALS_LINE).replace(re.escape("{trials}"), r"(\d+)")
    loaded = autotune.LOADED.split("{n}")[0]
    paired = logs(pair.engine)
    assert loaded in paired and [int(n) for n in re.findall(trials, paired)][:1] == [0], paired
    container, port, r = pair.run_variant("nocache", ('-v "$NAME-cache:/var/cache/wcache" ', ""))
    assert r.returncode == 0, r.stderr
    wait_until(lambda: healthy(port), 120, "engine /health 200", lambda: logs(container)[-6000:])
    log = logs(container)
    assert mapped_line() in log  # the socket volume is there: weights come from the daemon ...
    assert loaded not in log  # ... but the daemon's tuning results are not: it tunes again
    counts = [int(n) for n in re.findall(trials, log)]
    assert counts and counts[0] > 0, log


PEER_PROBE = """
import glob, socket
from wcache.wire.protocol import recv_frame, request, send_frame
s = socket.socket(socket.AF_UNIX)
s.connect(glob.glob("/run/wcache/sockets/*.sock")[0])
send_frame(s, request("get_memory"))
print(recv_frame(s)[0])
"""


def test_the_daemon_checks_the_peers_uid_even_when_the_socket_is_reachable(pair):
    # The second line of defence: open the directory and the socket to everyone for a moment, and
    # a process of another uid can connect, but the daemon refuses it (SO_PEERCRED).
    sock = docker("exec", pair.daemon, "sh", "-c", f"ls {SOCKET_DIR}/*.sock").stdout.strip()
    docker("exec", pair.daemon, "chmod", "755", SOCKET_DIR)
    docker("exec", pair.daemon, "chmod", "666", sock)
    try:
        r = docker("exec", "--user", "1000", pair.daemon, "python3", "-c", PEER_PROBE, check=False)
    finally:
        docker("exec", pair.daemon, "chmod", "700", SOCKET_DIR)
        docker("exec", pair.daemon, "chmod", "600", sock)
    rejected = errors.REASONS["rejected"].format(uid=1000)
    assert "'error': 'rejected'" in r.stdout and rejected in r.stdout, r.stdout + r.stderr
    assert rejected in logs(pair.daemon)
