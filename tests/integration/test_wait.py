"""`wcache wait`: the guide's way to wait for a daemon or engine started with `&`.

Real processes throughout: a real launcher and engine become ready while `wcache wait` runs beside
them, and the failures (timeout, the awaited process exiting first, nothing to wait for) are one
line and exit status 2 with errors.py's texts.
"""

from __future__ import annotations

import subprocess
import sys
import time

from procs import free_port, http
from wcache.errors import WaitError
from wcache.cli.flags import READY


def wait_cmd(*args: str, env: dict) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "wcache.cli", "wait", *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def one_line_exit_2(p: subprocess.Popen, message: str, timeout: float = 60.0) -> None:
    out, _ = p.communicate(timeout=timeout)
    assert p.returncode == 2, f"exit {p.returncode}\n{out}"
    lines = out.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], out
    assert "Traceback" not in out


def test_waits_for_the_daemon_and_the_engine_then_returns_0(procs, tiny_model, wcache_env):
    health_port, engine_port = free_port(), free_port()
    daemon = procs.preload(tiny_model, "--weight-cache-health-port", str(health_port),
                           "--weight-cache-health-host", "127.0.0.1", ready=False)
    daemon_health = f"http://127.0.0.1:{health_port}/health"
    waiter = wait_cmd("--log", str(daemon.log_path), "--health", daemon_health, "--pid", str(daemon.pid),
                      env=wcache_env)
    out, _ = waiter.communicate(timeout=120)
    assert waiter.returncode == 0, out
    # It returned because both held, not early: the READY line is there and /health says 200.
    assert READY in daemon.log()
    assert http("GET", daemon_health)[0] == 200

    engine = procs.serve(tiny_model, "--load-format", "ipc_cache", port=engine_port, ready=False)
    engine_health = f"http://127.0.0.1:{engine_port}/health"
    waiter = wait_cmd("--health", engine_health, "--pid", str(engine.pid), env=wcache_env)
    out, _ = waiter.communicate(timeout=120)
    assert waiter.returncode == 0, out
    assert http("GET", engine_health) == (200, {"status": "ok"})
    assert "Mapped" in engine.log()


def test_a_custom_text_in_a_log(tmp_path, wcache_env):
    log = tmp_path / "engine.log"
    log.write_text("INFO starting\n")
    waiter = wait_cmd("--log", str(log), "--text", "Waiting up to", "--timeout", "30", env=wcache_env)
    time.sleep(0.5)
    assert waiter.poll() is None, "returned before the text was written"
    with log.open("a") as f:
        f.write("INFO Waiting up to 300.0s for the weight cache daemon to start\n")
    assert waiter.wait(timeout=30) == 0


def test_timeout_is_one_line_and_exit_2(tmp_path, wcache_env):
    port = free_port()  # nothing listens there
    t0 = time.monotonic()
    waiter = wait_cmd("--health", f"http://127.0.0.1:{port}/health", "--log", str(tmp_path / "none.log"),
                      "--timeout", "1", env=wcache_env)
    expected = WaitError.TIMEOUT.format(
        timeout=1.0, what=f"GET http://127.0.0.1:{port}/health answering 200; {READY!r} in {tmp_path / 'none.log'}")
    one_line_exit_2(waiter, expected)
    assert time.monotonic() - t0 < 20


def test_a_process_that_exits_first_ends_the_wait_at_once(procs, tiny_model, wcache_env, tmp_path):
    # A daemon that refuses its configuration exits 2 right away; the wait must not sit out its timeout.
    daemon = procs.preload(tiny_model, "--load-format", "ipc_cache", ready=False)
    t0 = time.monotonic()
    waiter = wait_cmd("--log", str(daemon.log_path), "--pid", str(daemon.pid), "--timeout", "100", env=wcache_env)
    one_line_exit_2(waiter, WaitError.EXITED.format(pid=daemon.pid, what=f"{READY!r} in {daemon.log_path}"))
    assert time.monotonic() - t0 < 60
    assert daemon.exit_code() == 2


def test_nothing_to_wait_for_and_a_bad_timeout(wcache_env):
    one_line_exit_2(wait_cmd(env=wcache_env), WaitError.NOTHING)
    one_line_exit_2(wait_cmd("--log", "x", "--timeout", "0", env=wcache_env),
                    WaitError.BAD_TIMEOUT.format(timeout=0.0))


def test_wait_starts_without_importing_torch(tmp_path, wcache_env):
    """It runs between every start in a script; importing torch would add about 2 s to each."""
    log = tmp_path / "daemon.log"
    log.write_text(f"INFO {READY}\n")
    code = ("import sys\nfrom wcache import cli\n"
            f"rc = cli.main(['--log-level', 'INFO', 'wait', '--log', {str(log)!r}])\n"
            "print(rc, sorted(m for m in ('torch', 'safetensors', 'numpy') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], env=wcache_env, capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "0 []", out.stdout + out.stderr


def test_every_command_is_in_the_full_parser_and_the_help_lists_them():
    from wcache.cli import COMMANDS, build_parser, command_named

    assert command_named(["--log-level", "DEBUG", "wait", "--log", "x"]) == "wait"
    assert command_named(["--version"]) is None
    def commands(parser) -> list[str]:
        return list(next(a for a in parser._actions if a.dest == "command").choices)

    assert commands(build_parser()) == commands(build_parser("nonsense")) == list(COMMANDS)
    assert commands(build_parser("wait")) == ["wait"]
