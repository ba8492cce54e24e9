"""Configurations `wcache` refuses before loading anything: each its own message, exit status 2.

The quantization and load-format refusals run as real `wcache` processes, started side by side.
The socket-directory and loader-key checks run `wcache.cli.main` in this process (the same code
path up to the exit status, without paying an interpreter start per case).
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor

import pytest
from wcache.daemon.launcher import STOP_TIMEOUT_INVALID
from procs import free_port
from wcache import cli
from wcache.errors import (
    DeviceError,
    EngineWorldError,
    ServeAddressError,
    SocketSecurityError,
    UnsupportedQuantForIPCError,
)
from wcache.engine.loading.config import LOADER_KEYS

GPTQ = str(UnsupportedQuantForIPCError("gptq"))  # upstream's text and the reason


def serve(model, *extra):
    return ["serve", str(model), "--device", "cpu", "--host", "127.0.0.1", "--port", str(free_port()), *extra]


def preload(model, *extra):
    return ["preload", "--model", str(model), "--device", "cpu", *extra]


@pytest.fixture(scope="module")
def processes(tiny_model, module_env):
    """name -> (exit code, combined output) of real `wcache` processes."""
    cases = {
        "serve_gptq": serve(tiny_model, "-q", "gptq", "--load-format", "ipc_cache"),
        "serve_gptq_fallback_true": serve(tiny_model, "-q", "gptq", "--load-format", "ipc_cache",
                                          "--model-loader-extra-config", '{"fallback": true}'),
        "preload_gptq": preload(tiny_model, "-q", "gptq"),
        "preload_ipc_cache": preload(tiny_model, "--load-format", "ipc_cache"),
        "serve_typo": ["serve", "tiny", "--load-fromat", "ipc_cache"],
        "preload_typo": ["preload", "--modle", "x"],
    }

    def run(args):
        p = subprocess.run([sys.executable, "-m", "wcache.cli", *args], check=False, env=module_env, capture_output=True,
                           text=True, timeout=180)
        return p.returncode, p.stdout + p.stderr

    with ThreadPoolExecutor(max_workers=len(cases)) as pool:
        return dict(zip(cases, pool.map(run, cases.values())))


def check(code: int, out: str, message: str) -> None:
    assert code == 2, f"exit {code}\n{out}"
    assert message in out, f"{message!r} not in\n{out}"
    assert "Traceback" not in out, out


@pytest.mark.parametrize("name", ["serve_gptq", "serve_gptq_fallback_true", "preload_gptq"])
def test_a_quantization_without_pre_processed_weights_is_refused(processes, name):
    check(*processes[name], GPTQ)


def test_preload_refuses_load_format_ipc_cache(processes):
    check(*processes["preload_ipc_cache"], "--load-format ipc_cache cannot be used with `wcache preload`: "
                                           "the daemon itself must load the weights from disk")


@pytest.mark.parametrize("value", ["0", "-5", "nan"])
def test_preload_refuses_a_stop_timeout_that_is_not_positive(main, tiny_model, value):
    check(*main(*preload(tiny_model, "--weight-cache-stop-timeout", value)),
          STOP_TIMEOUT_INVALID.format(value=float(value)))


def test_preload_refuses_a_symlinked_socket_dir(main, tiny_model, tmp_path):
    (tmp_path / "real").mkdir(mode=0o700)
    (tmp_path / "link").symlink_to(tmp_path / "real")
    check(*main(*preload(tiny_model, "--weight-cache-socket-dir", str(tmp_path / "link"))),
          SocketSecurityError.SYMLINK_DIR.format(dir=tmp_path / "link"))


def test_preload_refuses_an_open_default_socket_dir(main, tiny_model, wcache_env):
    d = f"{wcache_env['TMPDIR']}/wcache_{os.getuid()}"
    os.mkdir(d)
    os.chmod(d, 0o755)
    assert tempfile.gettempdir() == wcache_env["TMPDIR"]
    check(*main(*preload(tiny_model)), SocketSecurityError.OPEN_DIR.format(dir=d))


def test_preload_refuses_a_socket_dir_of_another_user(main, tiny_model, tmp_path):
    if os.getuid() != 0:
        pytest.skip("needs root to chown a directory to another uid")
    d = tmp_path / "theirs"
    d.mkdir(mode=0o700)
    os.chown(d, 65534, 65534)
    check(*main(*preload(tiny_model, "--weight-cache-socket-dir", str(d))),
          SocketSecurityError.NOT_OWNED_DIR.format(dir=d))


def test_serve_refuses_a_bad_loader_mode(main, tiny_model):
    check(*main(*serve(tiny_model, "--load-format", "ipc_cache", "--model-loader-extra-config", '{"mode": "fast"}')),
          "mode must be one of ['zero_copy', 'copy'], got 'fast'")


def test_serve_refuses_an_unknown_loader_key(main, tiny_model):
    check(*main(*serve(tiny_model, "--load-format", "ipc_cache", "--model-loader-extra-config",
                       '{"fallback": true, "socket": "/x"}')),
          f"Unknown ipc_cache loader key(s) ['socket']; valid keys: {sorted(LOADER_KEYS)}")


def test_serve_on_a_taken_port_says_so_in_one_line(tiny_model, module_env):
    """Port 8000 taken by another server (here: a listening socket of this test) is the most common
    first-run failure; the quick start quotes this text."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        p = subprocess.run([sys.executable, "-m", "wcache.cli", "serve", str(tiny_model), "--device", "cpu",
                            "--host", "127.0.0.1", "--port", str(port)],
                           check=False, env=module_env, capture_output=True, text=True, timeout=180)
    out = p.stdout + p.stderr
    check(p.returncode, out, ServeAddressError.IN_USE.format(host="127.0.0.1", port=port))
    assert len([ln for ln in out.splitlines() if ln.strip()]) == 1, out


def one_line_error(out: str) -> list[str]:
    return [ln for ln in out.splitlines() if ln.startswith(("ERROR", "CRITICAL")) or "Error" in ln]


def test_serve_on_cuda_without_a_gpu_says_so_in_one_line(tiny_model, module_env):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this host has a CUDA device: --device cuda is not an error here")
    p = subprocess.run([sys.executable, "-m", "wcache.cli", *serve(tiny_model, "--device", "cuda")],
                       check=False, env=module_env, capture_output=True, text=True, timeout=180)
    out = p.stdout + p.stderr
    check(p.returncode, out, DeviceError.NO_CUDA)
    assert len([ln for ln in out.splitlines() if ln.strip()]) == 1, out


def test_serve_tp2_on_a_taken_master_port_says_so_in_one_line(tiny_model, module_env):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        p = subprocess.run([sys.executable, "-m", "wcache.cli", *serve(tiny_model, "-tp", "2", "--master-addr",
                                                                       "127.0.0.1", "--master-port", str(port))],
                           check=False, env=module_env, capture_output=True, text=True, timeout=180)
    out = p.stdout + p.stderr
    message = EngineWorldError.TEMPLATE.split("{error}")[0].format(rank=0, init_method=f"tcp://127.0.0.1:{port}")
    check(p.returncode, out, message)
    assert len(one_line_error(out)) == 1, out  # the INFO lines before it say what was starting


@pytest.mark.parametrize("value", ["0", "-5", "many"])
def test_serve_refuses_a_max_model_len_that_is_not_positive(main, tiny_model, value):
    with pytest.raises(SystemExit) as e:  # argparse: usage, then the error, status 2
        main(*serve(tiny_model, "--max-model-len", value))
    assert e.value.code == 2


# -- Mistyped flags: each command names the flag it was given and the nearest valid one -----------


def command_parser(command: str):
    parser = cli.build_parser(command)
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[command]


def typo(flag: str) -> str:
    """``flag`` with two letters of its name swapped (--load-format -> --load-fromat)."""
    i = len(flag) // 2 + 1
    return flag[:i] + flag[i + 1] + flag[i] + flag[i + 2:]


@pytest.mark.parametrize("command", list(cli.COMMANDS))
def test_a_mistyped_flag_is_named_with_the_nearest_valid_one(main, command):
    """For every subcommand: its own usage (not the top-level one), the typo, the flag meant, exit 2;
    before any required-argument check (`preload --modle x` once said only that --model is required)."""
    flags = [s for a in command_parser(command)._actions for s in a.option_strings if s.startswith("--")]
    meant = max((f for f in flags if f != "--help"), key=len)
    wrong = typo(meant)
    assert wrong not in flags
    with pytest.raises(SystemExit) as e:
        main(command, wrong, "x")
    out = main.capfd.readouterr().err
    assert e.value.code == 2
    assert out.startswith(f"usage: wcache {command} "), out
    assert f"wcache {command}: error: unrecognized argument {wrong}; did you mean {meant}?" in out, out


def test_a_mistyped_global_flag_is_named_too(main):
    with pytest.raises(SystemExit) as e:
        main("--log-levl", "DEBUG", "wait", "--timeout", "1")
    out = main.capfd.readouterr().err
    assert e.value.code == 2
    assert "wcache: error: unrecognized argument --log-levl; did you mean --log-level?" in out, out


@pytest.mark.parametrize("argv", [["wait", "--timeout", "-5"], ["wait", "--text=-x", "--timeout", "1", "--pid", "1"],
                                  ["wait", "--time", "1", "--text", "-x y"]])
def test_values_that_look_like_flags_and_abbreviations_are_not_refused(argv):
    """A negative number, a value after `=` or after its flag, and argparse's unambiguous
    abbreviations (--time for --timeout) parse as before."""
    args = cli.build_parser("wait").parse_args(argv)
    assert args.command == "wait"


def test_the_issue_s_typos_as_real_processes(processes):
    code, out = processes["serve_typo"]
    check(code, out, "wcache serve: error: unrecognized argument --load-fromat; did you mean --load-format?")
    assert "usage: wcache serve " in out
    code, out = processes["preload_typo"]
    check(code, out, "wcache preload: error: unrecognized argument --modle; did you mean --model?")
    assert "required" not in out, out
