"""Configurations `wcache` refuses before loading anything: each its own message, exit status 2.

Every case is a real `wcache` process; they are independent, so the module starts them side by
side (a few at a time) and each test checks one of them.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from procs import free_port

from wcache.errors import SocketSecurityError, UnsupportedQuantForIPCError
from wcache.loader import LOADER_KEYS

GPTQ = UnsupportedQuantForIPCError.TEMPLATE.format(method="gptq")


def serve(model, *extra):
    return ["serve", str(model), "--device", "cpu", "--host", "127.0.0.1", "--port", str(free_port()), *extra]


def preload(model, *extra):
    return ["preload", "--model", str(model), "--device", "cpu", *extra]


@pytest.fixture(scope="module")
def results(tiny_model, module_env):
    """name -> (exit code, combined output, the directory the case was about)."""
    base = Path(tempfile.mkdtemp(prefix="wc-cli-", dir="/tmp"))
    real = base / "real"
    real.mkdir(mode=0o700)
    (base / "link").symlink_to(real)
    open_tmp = base / "open"  # a TMPDIR whose default socket dir exists with mode 0755
    (open_tmp / f"wcache_{os.getuid()}").mkdir(parents=True)
    os.chmod(open_tmp / f"wcache_{os.getuid()}", 0o755)
    theirs = base / "theirs"
    theirs.mkdir(mode=0o700)
    cases = {
        "serve_gptq": (serve(tiny_model, "-q", "gptq", "--load-format", "ipc_cache"), {}, None),
        "serve_gptq_fallback_true": (serve(tiny_model, "-q", "gptq", "--load-format", "ipc_cache",
                                           "--model-loader-extra-config", '{"fallback": true}'), {}, None),
        "preload_gptq": (preload(tiny_model, "-q", "gptq"), {}, None),
        "preload_ipc_cache": (preload(tiny_model, "--load-format", "ipc_cache"), {}, None),
        "preload_symlinked_dir": (preload(tiny_model, "--weight-cache-socket-dir", str(base / "link")), {}, base / "link"),
        "preload_open_default_dir": (preload(tiny_model), {"TMPDIR": str(open_tmp)}, open_tmp / f"wcache_{os.getuid()}"),
        "serve_bad_mode": (serve(tiny_model, "--load-format", "ipc_cache", "--model-loader-extra-config",
                                 '{"mode": "fast"}'), {}, None),
        "serve_unknown_key": (serve(tiny_model, "--load-format", "ipc_cache", "--model-loader-extra-config",
                                    '{"fallback": true, "socket": "/x"}'), {}, None),
    }
    if os.getuid() == 0:
        os.chown(theirs, 65534, 65534)
        cases["preload_foreign_dir"] = (preload(tiny_model, "--weight-cache-socket-dir", str(theirs)), {}, theirs)

    def run(case):
        args, env, _ = case
        p = subprocess.run([sys.executable, "-m", "wcache.cli", *args], env={**module_env, **env},
                           capture_output=True, text=True, timeout=180)
        return p.returncode, p.stdout + p.stderr

    with ThreadPoolExecutor(max_workers=4) as pool:
        done = dict(zip(cases, pool.map(run, cases.values())))
    yield {name: (*done[name], cases[name][2]) for name in cases}
    os.chown(theirs, os.getuid(), os.getgid()) if os.getuid() == 0 else None
    import shutil

    shutil.rmtree(base, ignore_errors=True)


def check(results, name: str, message: str) -> None:
    code, out, _ = results[name]
    assert code == 2, f"{name}: exit {code}\n{out}"
    assert message in out, f"{name}: {message!r} not in\n{out}"
    assert "Traceback" not in out, out


@pytest.mark.parametrize("name", ["serve_gptq", "serve_gptq_fallback_true", "preload_gptq"])
def test_a_quantization_without_pre_processed_weights_is_refused(results, name):
    check(results, name, GPTQ)


def test_preload_refuses_load_format_ipc_cache(results):
    check(results, "preload_ipc_cache", "--load-format ipc_cache cannot be used with `wcache preload`: "
                                        "the daemon itself must load the weights from disk")


def test_preload_refuses_a_symlinked_socket_dir(results):
    check(results, "preload_symlinked_dir", SocketSecurityError.SYMLINK_DIR.format(dir=results["preload_symlinked_dir"][2]))


def test_preload_refuses_an_open_default_socket_dir(results):
    check(results, "preload_open_default_dir", SocketSecurityError.OPEN_DIR.format(dir=results["preload_open_default_dir"][2]))


def test_preload_refuses_a_socket_dir_of_another_user(results):
    if "preload_foreign_dir" not in results:
        pytest.skip("needs root to chown a directory to another uid")
    check(results, "preload_foreign_dir", SocketSecurityError.NOT_OWNED_DIR.format(dir=results["preload_foreign_dir"][2]))


def test_serve_refuses_a_bad_loader_mode(results):
    check(results, "serve_bad_mode", "mode must be one of ['zero_copy', 'copy'], got 'fast'")


def test_serve_refuses_an_unknown_loader_key(results):
    check(results, "serve_unknown_key", f"Unknown ipc_cache loader key(s) ['socket']; valid keys: {sorted(LOADER_KEYS)}")
