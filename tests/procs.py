"""Real wcache processes for tests: start, wait for readiness by log line or /health, always stop."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import warnings
from pathlib import Path

import pytest

READY = "Weight cache daemon READY"


@contextlib.contextmanager
def private_env(cache_root: Path, prefix: str = "wc-", **extra: str):
    """A private TMPDIR (so the default socket dir is the caller's own) and cache root, set for this
    process and returned for the processes it starts; the TMPDIR is removed afterwards.

    The TMPDIR is short, under /tmp: a Unix socket path must fit in 107 bytes, and pytest's tmp
    paths are long. ``extra`` adds more variables (set here as well).
    """
    tmp = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    env = {**os.environ, "TMPDIR": str(tmp), "WCACHE_CACHE_ROOT": str(cache_root), "PYTHONUNBUFFERED": "1", **extra}
    mp = pytest.MonkeyPatch()
    for k in ("TMPDIR", "WCACHE_CACHE_ROOT", *extra):
        mp.setenv(k, env[k])
    mp.setattr(tempfile, "tempdir", None)  # re-read TMPDIR in this process
    try:
        yield env
    finally:
        mp.undo()
        shutil.rmtree(tmp, ignore_errors=True)


def child_pids(pid: int) -> list[int]:
    """The live children of `pid`, found by their parent pid in /proc/*/stat.

    Not /proc/PID/task/TID/children: a thread can end between listing the tasks and reading its
    file (a FileNotFoundError that once failed CI), and that file only lists one thread's children.
    """
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:  # the process ended while we looked
            continue
        # Field 4 is the parent pid; the command name (field 2) may hold spaces, so split after ')'.
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            found.append(int(entry))
    return sorted(found)


def engine_workers(serve_pid: int) -> list[int]:
    """The other local ranks of a `wcache serve` process: its children, or with
    two processes (a front and an engine core, the default) the engine core's."""
    workers = []
    for child in child_pids(serve_pid):
        try:
            core = b"wcache.engine.core.core_proc" in Path(f"/proc/{child}/cmdline").read_bytes()
        except OSError:
            continue
        workers += child_pids(child) if core else [child]
    return workers


def engine_pid(serve_pid: int) -> int:
    """The process of a running `wcache serve` that holds engine rank 0 (the one a daemon's log names
    when it adopts the engine's arena): its engine core with two processes (the default), else itself."""
    if not two_processes():
        return serve_pid
    cores = core_pids(serve_pid)
    assert len(cores) == 1, f"wcache serve pid {serve_pid} has engine cores {cores}"
    return cores[0]


def children_running(pid: int, module: str) -> list[int]:
    """The children of ``pid`` started as ``python -m module`` (those gone meanwhile left out)."""
    out = []
    for child in child_pids(pid):
        try:
            if module.encode() in Path(f"/proc/{child}/cmdline").read_bytes():
                out.append(child)
        except OSError:
            continue
    return out


def core_pids(serve_pid: int) -> list[int]:
    """The engine cores a `wcache serve` front started (a --respawn front: the serving one and its spare)."""
    return children_running(serve_pid, "wcache.engine.core.core_proc")


ONE_PROCESS = {"WCACHE_ENABLE_V1_MULTIPROCESSING": "0"}  # `wcache serve` as one process (two are the default)


@contextlib.contextmanager
def one_process():
    """For a test module about the one-process engine's internals: every `wcache serve` it starts,
    and this process's own reading of the mode, run the engine inside the server process."""
    mp = pytest.MonkeyPatch()
    mp.setenv("WCACHE_ENABLE_V1_MULTIPROCESSING", "0")
    try:
        yield
    finally:
        mp.undo()


def two_processes() -> bool:
    """Whether this run's `wcache serve` is a front and an engine core (engine/api_server/front.py):
    the default, unless the variable is 0."""
    return os.environ.get("WCACHE_ENABLE_V1_MULTIPROCESSING", "1") == "1"


def alive(pid: int) -> bool:
    """Whether ``pid`` runs: a zombie (exited, not yet reaped by whoever adopted it) does not."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


def wait_until(predicate, timeout: float = 30.0, what: str = "condition", on_timeout=lambda: "", *,
               interval: float = 0.05) -> None:
    """Poll ``predicate`` until true; fail naming ``what`` (and ``on_timeout()``'s text) after ``timeout``."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}\n{on_timeout()}".rstrip())
        time.sleep(interval)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http(method: str, url: str, body=None, timeout: float = 60.0) -> tuple[int, dict]:
    """(status, JSON body) for a request; 4xx/5xx are returned, not raised."""
    data = body if isinstance(body, (bytes, type(None))) else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


class Proc:
    """A `wcache ...` subprocess whose combined output goes to a log file."""

    def __init__(self, args: list[str], env: dict, log: Path):
        self.args, self.log_path = args, log
        self._log = log.open("wb")
        self.proc = subprocess.Popen([sys.executable, "-m", "wcache.cli", *args], env=env,
                                     stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_for(self, predicate, timeout: float = 120.0, what: str = "readiness") -> "Proc":
        deadline = time.monotonic() + timeout
        while not predicate():
            if self.proc.poll() is not None:
                raise AssertionError(f"{self.args[0]} exited with {self.proc.returncode} before {what}:\n{self.log()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"{self.args[0]}: no {what} within {timeout}s:\n{self.log()}")
            time.sleep(0.05)
        return self

    def wait_for_log(self, text: str, timeout: float = 120.0) -> "Proc":
        return self.wait_for(lambda: text in self.log(), timeout, repr(text))

    def exit_code(self, timeout: float = 60.0) -> int:
        return self.proc.wait(timeout)

    def stop(self, sig=signal.SIGTERM, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                # Not a failure of the test that ran, but a stop an operator would wait for: say
                # which process and what it logged last, in the run's warnings summary.
                warnings.warn(f"`wcache {' '.join(self.args)}` still ran {timeout:g} s after signal {sig}; killed. "
                              f"Its last lines:\n{self.log()[-1500:]}", stacklevel=2)
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._log.close()
        return self.proc.returncode

    def kill_group(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()


class Processes:
    """Factory fixture: every process it starts is stopped at teardown (SIGTERM, then SIGKILL)."""

    def __init__(self, tmp: Path, env: dict, device: str = "cpu"):
        self.tmp, self.env, self.started, self.device = tmp, env, [], device

    def start(self, *args: str, name: str | None = None, env: dict | None = None) -> Proc:
        name = name or f"{args[0]}-{len(self.started)}"
        p = Proc(list(args), {**self.env, **(env or {})}, self.tmp / f"{name}.log")
        self.started.append(p)
        return p

    def preload(self, model, *extra: str, ready: bool = True, **kw) -> Proc:
        p = self.start("preload", "--model", str(model), "--device", self.device, *extra, **kw)
        return p.wait_for_log(READY) if ready else p

    def serve(self, model, *extra: str, port: int | None = None, ready: bool = True, **kw) -> Proc:
        port = port or free_port()
        if "--shutdown-delay" not in extra:  # no load balancer routes to a test's engine: stop at once
            extra = (*extra, "--shutdown-delay", "0")
        p = self.start("serve", str(model), "--device", self.device, "--host", "127.0.0.1", "--port", str(port), *extra, **kw)
        p.port = port
        if ready:
            p.wait_for(lambda: _healthy(port), what="/health 200")
        return p

    def stop_all(self) -> None:
        for p in reversed(self.started):
            try:
                p.stop(timeout=30)
            except Exception:
                p.kill_group()


def _healthy(port: int) -> bool:
    try:
        return http("GET", f"http://127.0.0.1:{port}/health", timeout=1)[0] == 200
    except OSError:
        return False


def complete(port: int, prompt: str = "Hello", max_tokens: int = 8) -> dict:
    status, body = http("POST", f"http://127.0.0.1:{port}/v1/completions", {"prompt": prompt, "max_tokens": max_tokens})
    assert status == 200, body
    return body


def call(path, op: str, timeout: float = 10.0, **fields) -> dict:
    """One request to a daemon socket on a fresh connection; descriptors that come back are closed."""
    from wcache.wire.protocol import close_fds, recv_frame, request, send_frame

    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        s.connect(str(path))
        send_frame(s, request(op, **fields))
        answer, fds = recv_frame(s)
        close_fds(fds)
        return answer
