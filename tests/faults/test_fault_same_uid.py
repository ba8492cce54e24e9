"""A process of wcache's own uid cannot read its memory or take its descriptors.

Linux gives a process of the same uid ptrace access to another: ``/proc/PID/mem`` (the weights, the
heap, an API key), ``pidfd_getfd`` (the listening socket, the arena's memfd). Every wcache process
clears its dumpable flag (core/no_dump.py), which takes that access away from any caller without
CAP_SYS_PTRACE. Root has that capability, so wcache and the attacker both run as uid 65534
(``setpriv``), as tests/faults/test_fault_fds_in_flight.py does: the daemon's launcher and rank, the
``--respawn`` supervisor, its serving worker and its spare, and a tensor-parallel engine's second
rank (``wcache.engine.worker.runner``). What the attacker can still do is what docs/security.md says:
signal them (the test's own stop does that) and connect to their sockets.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
from faultlib import TALLY, wait_until
from procs import child_pids, engine_pid, engine_workers, free_port, http, two_processes
from test_fault_fds_in_flight import as_other, other_home  # noqa: F401  (other_home: a fixture)

# For each pid: read 16 bytes of its first readable mapping through /proc/PID/mem, and take its
# descriptor 2 (its log) with pidfd_getfd, and check that it may signal it; each answers "ok" or the
# error's errno name.
ATTACKER = r"""
import ctypes, errno, json, os, sys
libc = ctypes.CDLL(None, use_errno=True)
SYS_pidfd_open, SYS_pidfd_getfd = 434, 438  # x86_64 and aarch64 alike

def err(e):
    return errno.errorcode.get(e, str(e))

def mem(pid):
    try:
        with open(f"/proc/{pid}/mem", "rb") as f:
            for line in open(f"/proc/{pid}/maps"):
                start, perms = line.split()[0].split("-")[0], line.split()[1]
                if perms.startswith("r"):
                    f.seek(int(start, 16))
                    return "ok" if len(f.read(16)) == 16 else "short"
    except OSError as e:
        return err(e.errno)
    return "no readable mapping"

def signal(pid):  # what the same uid still may: kill(pid, 0) checks the permission to signal
    try:
        os.kill(pid, 0)
        return "ok"
    except OSError as e:
        return err(e.errno)

def getfd(pid):
    pidfd = libc.syscall(SYS_pidfd_open, pid, 0)
    if pidfd < 0:
        return "pidfd_open: " + err(ctypes.get_errno())
    fd = libc.syscall(SYS_pidfd_getfd, pidfd, 2, 0)
    e = ctypes.get_errno()
    os.close(pidfd)
    if fd < 0:
        return err(e)
    os.close(fd)
    return "ok"

print(json.dumps({pid: {"mem": mem(int(pid)), "pidfd_getfd": getfd(int(pid)), "signal": signal(int(pid))} for pid in sys.argv[1:]}))
"""


def others_may_run(path: str) -> bool:
    """Whether every directory above ``path`` is searchable by other users, and the file theirs to run."""
    p = Path(path)
    return all(os.stat(d).st_mode & 0o001 for d in p.parents) and bool(os.stat(p).st_mode & 0o001)


def interpreter_for_others(base: Path) -> str:
    """A venv under ``base`` that uid 65534 can run and re-run by its own ``sys.executable``: the
    launcher and the supervisor start their children so. Its interpreter is this one's base, else
    the system's of the same version where this one's lies where others cannot search (/root), and
    its site-packages are this venv's (the same minor version: the same ABI)."""
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    candidates = [getattr(sys, "_base_executable", sys.executable), f"/usr/local/bin/{version}", f"/usr/bin/{version}"]
    usable = [os.path.realpath(c) for c in candidates if os.path.exists(c) and others_may_run(os.path.realpath(c))]
    if not usable:
        pytest.skip(f"no {version} that uid 65534 may run")
    venv = base / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "lib" / version).mkdir(parents=True)
    (venv / "bin" / "python").symlink_to(usable[0])
    (venv / "lib" / version / "site-packages").symlink_to(sysconfig.get_paths()["purelib"])
    (venv / "pyvenv.cfg").write_text(f"home = {Path(usable[0]).parent}\ninclude-system-site-packages = false\n")
    for d in (base, venv, venv / "bin", venv / "lib", venv / "lib" / version):
        os.chmod(d, 0o755)
    return str(venv / "bin" / "python")


def attack(env: dict, pids: dict[str, int]) -> dict[str, dict]:
    """{kind: {"mem": ..., "pidfd_getfd": ...}} as uid 65534 sees each of ``pids``."""
    out = subprocess.run(as_other(env["WCACHE_TEST_PYTHON"], "-c", ATTACKER, *map(str, pids.values())), env=env,
                         capture_output=True, text=True, timeout=60, check=True)
    got = json.loads(out.stdout)
    return {kind: got[str(pid)] for kind, pid in pids.items()}


def start(env: dict, log: Path, *args: str) -> subprocess.Popen:
    with log.open("wb") as out:
        return subprocess.Popen(as_other(env["WCACHE_TEST_PYTHON"], "-m", "wcache.cli", *args), env=env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)


def stop(proc: subprocess.Popen) -> None:
    # A signal from another uid is refused, but this test is root: it reaches uid 65534's processes.
    if proc.poll() is None:
        os.killpg(proc.pid, 15)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()


def healthy(port: int) -> bool:
    try:
        return http("GET", f"http://127.0.0.1:{port}/health", timeout=1)[0] == 200
    except OSError:
        return False


def serve(env: dict, log: Path, model: Path, *extra: str) -> tuple[subprocess.Popen, int]:
    port = free_port()
    proc = start(env, log, "serve", str(model), "--device", "cpu", "--host", "127.0.0.1", "--port", str(port),
                 "--shutdown-delay", "0", *extra)
    wait_until(lambda: healthy(port) or proc.poll() is not None, 240, "/health 200", log.read_text)
    assert proc.poll() is None, log.read_text()
    return proc, port


REFUSED = {"mem": "EACCES", "pidfd_getfd": "EPERM", "signal": "ok"}


@pytest.mark.slow  # a daemon, a respawn engine and a two-rank engine, each as uid 65534
def test_a_process_of_the_same_uid_cannot_read_memory_or_take_descriptors(other_home, tmp_path):
    TALLY.fault("a process of the same uid reads memory and takes descriptors")
    model, home, env = other_home
    env = {**env, "WCACHE_TEST_PYTHON": interpreter_for_others(home.parent / "python")}
    procs = []
    try:
        preload = start(env, tmp_path / "preload.log", "preload", "--model", str(model), "--device", "cpu")
        procs.append(preload)
        wait_until(lambda: "READY" in (tmp_path / "preload.log").read_text() or preload.poll() is not None, 240,
                   "the daemon's READY", (tmp_path / "preload.log").read_text)
        [rank] = child_pids(preload.pid)
        kinds = {"daemon launcher": preload.pid, "daemon rank": rank}

        supervisor, port = serve(env, tmp_path / "respawn.log", model, "--respawn")
        procs.append(supervisor)
        # Two processes (the default): the front, its serving engine core and its spare core; one
        # (WCACHE_ENABLE_V1_MULTIPROCESSING=0): the supervisor, its serving worker and its spare.
        wait_until(lambda: len(child_pids(supervisor.pid)) == 2, 120, "the serving engine and its spare")
        worker, spare = child_pids(supervisor.pid)
        kinds |= {"respawn front or supervisor": supervisor.pid, "respawn serving engine": worker,
                  "respawn spare": spare}

        # a free master port: the default (29501) is the guide's, whose pages (parallelism.md) run on the
        # other worker at the same time; both CI failures of this pair were EADDRINUSE on 29501
        front, _ = serve(env, tmp_path / "tp2.log", model, "--tensor-parallel-size", "2", "--load-format",
                         "safetensors", "--master-port", str(free_port()))
        procs.append(front)
        [runner] = [p for p in engine_workers(front.pid)
                    if "wcache.engine.worker.runner" in Path(f"/proc/{p}/cmdline").read_text()]
        kinds |= {"engine (rank 0)": engine_pid(front.pid), "engine worker (rank 1)": runner}
        if two_processes():
            kinds["engine front"] = front.pid

        got = attack(env, kinds)
        assert got == {kind: REFUSED for kind in kinds}, json.dumps(got, indent=1)
        assert healthy(port)  # and the engine serves on
    finally:
        for p in reversed(procs):
            stop(p)
