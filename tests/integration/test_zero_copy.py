"""Proof of zero-copy on CPU with the `small` checkpoint (about 470 MB): an engine that maps the
daemon's arena does not grow its private memory by the weights, a disk-loaded engine does, and a
write into a mapped weight kills the engine (SIGSEGV) while the daemon keeps serving.

Each engine is a real process (engine_probe.py) that reads its own /proc/self/smaps_rollup.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
from itest import HERE, call, default_socket, wait_until

pytestmark = pytest.mark.slow

MB = 1 << 20


@pytest.fixture(scope="module")
def daemon(module_procs, small_model):
    return module_procs.preload(small_model)


def probe(model, env, *flags) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(HERE / "engine_probe.py"), str(model), *flags], check=False, env=env,
                          capture_output=True, text=True, timeout=300)


def report(p: subprocess.CompletedProcess) -> dict:
    return json.loads(p.stdout.splitlines()[0])


def grew(r: dict, phase: str, field: str) -> int:
    return r[phase][field] - r["before"][field]


def test_mapping_is_zero_copy_and_read_only(daemon, small_model, module_env):
    sock = default_socket(module_env)
    with ThreadPoolExecutor(2) as pool:
        disk_run = pool.submit(probe, small_model, module_env, "--load-format", "safetensors")
        # Maps, touches every weight page, reports, then writes into a weight.
        mapped_run = pool.submit(probe, small_model, module_env, "--load-format", "ipc_cache", "--write")
    disk, mapped = disk_run.result(), mapped_run.result()
    assert disk.returncode == 0, disk.stderr
    d, m = report(disk), report(mapped)
    weights = m["weights_bytes"]
    assert weights > 400 * MB and d["weights_bytes"] == weights
    assert m["source"] == "the weight cache (zero_copy)" and d["source"] == "disk"
    assert m["checksum"] == d["checksum"]  # the same values from both sources

    summary = (f"weights {weights / MB:.0f} MiB; private growth: disk {grew(d, 'loaded', 'private') / MB:.0f} MiB, "
               f"zero_copy {grew(m, 'touched', 'private') / MB:.0f} MiB after touching every page "
               f"(shared +{grew(m, 'touched', 'shared') / MB:.0f} MiB)")
    print(summary)
    assert grew(d, "loaded", "private") > 0.8 * weights, summary
    assert grew(m, "loaded", "private") < 0.02 * weights, summary
    assert grew(m, "touched", "private") < 0.1 * weights, summary  # Private_Clean + Private_Dirty
    assert grew(m, "touched", "shared") > 0.9 * weights, summary  # the daemon's pages, mapped

    # The write: the kernel kills the engine, nothing reaches the daemon's memory.
    assert mapped.returncode == -signal.SIGSEGV, (mapped.returncode, mapped.stdout, mapped.stderr)
    assert '"wrote"' not in mapped.stdout

    wait_until(lambda: call(sock, "get_memory")["zero_copy_engines"] == 0, 10, "the dead engine's lease to end")
    again = probe(small_model, module_env, "--load-format", "ipc_cache")
    assert again.returncode == 0, again.stderr
    assert report(again)["checksum"] == d["checksum"]  # the daemon still serves the same weights
    assert daemon.proc.poll() is None
