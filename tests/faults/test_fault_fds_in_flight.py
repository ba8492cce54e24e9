"""A process of the daemon's user parks descriptors in flight, so the kernel refuses the daemon's.

The kernel counts, per user, the descriptors sent over Unix sockets and not yet received, and
refuses a sender more once that count exceeds the sender's RLIMIT_NOFILE (ETOOMANYREFS). A process
of the daemon's uid that sends a /dev/null descriptor to itself a few thousand times, and never
receives it, makes every get_state answer (which carries the arena's descriptor) fail. The daemon
must say so, keep serving, and the engine must name that cause in its fallback reason instead of
"the daemon may have crashed".

Root is exempt from the limit (CAP_SYS_RESOURCE), so the daemon, the attacker and the engine run
as uid 65534 (``setpriv``), the first directly as a daemon rank process (``python -m
wcache.daemon.rank``, what `wcache preload` starts): uid 65534 cannot search /root, where this
interpreter lives, so it could not start a second interpreter by its path as the launcher does.
"""

from __future__ import annotations

import json
import os
import select
import shutil
import subprocess
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

import pytest
from faultlib import TALLY, alive, wait_until
from wcache.core.config import Ranks
from wcache.daemon.rank import REFUSED_LOG
from wcache.errors import DAEMON_ERRORS, FALLBACK, REASONS

OTHER = 65534

# Park descriptors until the kernel refuses this process more: the count then exceeds its own
# RLIMIT_NOFILE, which is the daemon's too (both inherit this test's; the daemon only ever raises its
# soft limit up to a number this machine's already exceeds, or to the hard limit, which the attacker may too).
ATTACKER = r"""
import array, errno, os, resource, socket, sys
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
a, b = socket.socketpair()
fd = os.open("/dev/null", os.O_RDONLY)
parked = 0
while True:  # each message carries 250 references to one descriptor; b never receives them
    try:
        a.sendmsg([b"x"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd] * 250))])
    except OSError as e:
        assert e.errno == errno.ETOOMANYREFS, e
        break
    parked += 250
print(parked, flush=True)
sys.stdin.readline()
"""

ENGINE = r"""
import json, logging, sys
from wcache.core.config import EngineConfig
from wcache.engine.loading.config import LoaderConfig
from wcache.engine.loading.registry import load_weights
logging.basicConfig(level=logging.INFO, stream=sys.stderr)
cfg = EngineConfig.build(sys.argv[1], "auto", None, "cpu")
_, report, lease = load_weights(cfg, "ipc_cache", LoaderConfig(socket_dir=sys.argv[2]))
print(json.dumps({"source": report.source, "reason": report.fallback_reason}), flush=True)
"""


def as_other(*args: str) -> list[str]:
    return ["setpriv", "--reuid", str(OTHER), "--regid", str(OTHER), "--clear-groups", *args]


def interpreter() -> str:
    """This venv's interpreter by a path that uid 65534 can execute (the venv may be a symlink)."""
    venv = Path(os.path.realpath(sys.prefix)) / "bin" / "python"
    return str(venv) if venv.exists() else sys.executable


def open_files_limit(pid: int) -> int:
    for line in Path(f"/proc/{pid}/limits").read_text().splitlines():
        if line.startswith("Max open files"):
            return int(line.split()[3])
    raise AssertionError(f"no open files limit for pid {pid}")


@pytest.fixture
def other_home(tiny_model):
    if os.getuid() != 0:
        pytest.skip("needs root to run the daemon, attacker and engine as uid 65534 (setpriv): root itself is "
                    "exempt from the kernel's in-flight descriptor limit")
    if not shutil.which("setpriv"):
        pytest.skip("setpriv (util-linux) is not installed")
    base = Path(tempfile.mkdtemp(prefix="wc-refs-", dir="/tmp"))
    try:
        os.chmod(base, 0o755)
        model = shutil.copytree(tiny_model, base / "model")
        os.chmod(model, 0o755)
        for f in model.iterdir():
            os.chmod(f, 0o644)  # readable by uid 65534; the copy keeps the original's private modes
        home = base / "home"
        for sub in ("tmp", "cache", "state"):
            (home / sub).mkdir(parents=True)
        for p in [home, *home.iterdir()]:
            os.chown(p, OTHER, OTHER)
            os.chmod(p, 0o700)
        env = {"PATH": os.environ["PATH"], "PYTHONPATH": os.environ.get("PYTHONPATH", ""), "HOME": str(home),
               "TMPDIR": str(home / "tmp"), "WCACHE_CACHE_ROOT": str(home / "cache"),
               "WCACHE_STATE_DIR": str(home / "state"), "PYTHONUNBUFFERED": "1"}
        yield model, home, env
    finally:
        shutil.rmtree(base, ignore_errors=True)


def start_rank(model: Path, env: dict, log: Path) -> tuple[subprocess.Popen, dict]:
    """A daemon rank of uid 65534, as `wcache preload` starts it; (process, its ready line)."""
    r, w = os.pipe()
    spec = {"model": str(model), "dtype": "auto", "quantization": None, "device": "cpu", "revision": None,
            "socket_dir": None, "transport": "auto", "adopt": False, "autotune": False, "log_level": "INFO",
            "ranks": asdict(Ranks()), "ready_fd": w}
    with log.open("wb") as out:
        proc = subprocess.Popen(as_other(interpreter(), "-m", "wcache.daemon.rank"), pass_fds=(w,),
                                env={**env, "WCACHE_RANK_SPEC": json.dumps(spec)}, stdout=out, stderr=subprocess.STDOUT)
    os.close(w)
    with os.fdopen(r) as ready:
        if not select.select([ready], [], [], 120)[0]:
            proc.kill()
            raise AssertionError(f"the rank did not get ready:\n{log.read_text()}")
        line = ready.readline()
    assert line, f"the rank exited with {proc.wait()}:\n{log.read_text()}"
    return proc, json.loads(line)


def engine_load(model: Path, sock: Path, env: dict) -> dict:
    out = subprocess.run(as_other(interpreter(), "-c", ENGINE, str(model), str(sock.parent)), env=env,
                         capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@pytest.mark.slow  # starts a daemon and three engines: tens of seconds
def test_descriptors_parked_in_flight_by_the_same_user_are_named_and_the_daemon_serves_on(other_home, tmp_path):
    TALLY.fault("descriptors of the daemon's user parked in flight")
    model, _home, env = other_home
    log = tmp_path / "rank.log"
    rank, info = start_rank(model, env, log)
    sock = Path(info["socket"])
    attacker = None
    try:
        assert engine_load(model, sock, env)["source"] != "disk"  # it serves before the attack
        limit = open_files_limit(rank.pid)
        attacker = subprocess.Popen(as_other(interpreter(), "-c", ATTACKER), env=env,
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert int(attacker.stdout.readline()) > limit

        got = engine_load(model, sock, env)
        detail = DAEMON_ERRORS["fds_in_flight"].format(uid=OTHER, limit=limit)
        assert got == {"source": "disk", "reason": REASONS["fds_in_flight"].format(path=sock, detail=detail)}
        assert got["reason"] == (f"The weight cache daemon at {sock} cannot pass its memory to this engine: too many file "
                                 "descriptors in flight for this user (ETOOMANYREFS): the kernel refused to pass the "
                                 f"arena's descriptor, because processes of uid {OTHER} hold more than {limit} descriptors "
                                 "sent over Unix sockets and not yet received; see the daemon's log")
        assert "may have crashed" not in got["reason"]
        wait_until(lambda: "fds_in_flight" in log.read_text(), 10, "the daemon's log line")
        assert REFUSED_LOG % ("get_state", int(log.read_text().split("from pid ")[-1].split()[0]), "fds_in_flight",
                              detail) in log.read_text()
        print(FALLBACK.format(reason=got["reason"]))
        assert alive(rank.pid)

        attacker.stdin.close()  # it exits, and its descriptors leave with it
        attacker.wait(30)
        assert engine_load(model, sock, env)["source"] != "disk"  # the same daemon serves the next engine
        rank.terminate()
        assert rank.wait(30) == 0
    finally:  # the rank and the attacker run as another user, out of the fixtures' reach
        if attacker is not None and attacker.poll() is None:
            attacker.kill()
            attacker.wait(30)
        if rank.poll() is None:
            rank.kill()
            rank.wait(30)
