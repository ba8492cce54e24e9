"""`make demo`: the main job on CPU with defaults, end to end, with real processes.

1. make a tiny checkpoint; 2. serve it from disk and ask for one completion; 3. start the weight
cache daemon, restart the engine with ``--load-format ipc_cache`` and ask again; 4. print both load
times and both answers (they must be equal), then stop everything cleanly.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

PROMPT = "The weight cache keeps"
LOAD_LINE = re.compile(r"Loaded (\d+) tensors \(([\d.]+) MiB\) from (.+) in ([\d.]+) s")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wcache(*args: str, log: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "wcache.cli", *args], stdout=log.open("wb"),
                            stderr=subprocess.STDOUT)


def wait_for(predicate, proc: subprocess.Popen, log: Path, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if proc.poll() is not None or time.monotonic() > deadline:
            sys.exit(f"demo: process failed; its log:\n{log.read_text()}")
        time.sleep(0.1)


def healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
            return r.status == 200
    except OSError:
        return False


def complete(port: int) -> str:
    body = json.dumps({"prompt": PROMPT, "max_tokens": 12}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.load(r)["choices"][0]["text"]


def stop(proc: subprocess.Popen) -> int:
    proc.send_signal(signal.SIGTERM)
    return proc.wait(60)


def serve_once(model: Path, work: Path, name: str, *extra: str) -> tuple[str, str]:
    port, log = free_port(), work / f"{name}.log"
    engine = wcache("serve", str(model), "--host", "127.0.0.1", "--port", str(port), *extra, log=log)
    try:
        wait_for(lambda: healthy(port), engine, log)
        answer = complete(port)
    finally:
        code = stop(engine)
    if code != 0:
        sys.exit(f"demo: engine exited with {code}:\n{log.read_text()}")
    m = LOAD_LINE.search(log.read_text())
    return f"{m.group(4)} s from {m.group(3)}", answer


def main() -> int:
    work = Path(tempfile.mkdtemp(prefix="wcache-demo-"))
    os.environ["TMPDIR"] = str(work)  # a private default socket directory for this demo
    model = work / "tiny"
    subprocess.run([sys.executable, "-m", "wcache.cli", "make-checkpoint", str(model), "--preset", "tiny"],
                   check=True)

    disk_time, disk_answer = serve_once(model, work, "engine-disk")
    print(f"engine loaded weights in {disk_time}")
    print(f"completion: {PROMPT!r} -> {disk_answer!r}")

    daemon_log = work / "daemon.log"
    daemon = wcache("preload", "--model", str(model), log=daemon_log)
    wait_for(lambda: "Weight cache daemon READY" in daemon_log.read_text(), daemon, daemon_log)
    print("weight cache daemon READY")
    try:
        cache_time, cache_answer = serve_once(model, work, "engine-cache", "--load-format", "ipc_cache")
    finally:
        daemon_code = stop(daemon)
    print(f"engine restarted with --load-format ipc_cache: weights in {cache_time}")
    print(f"completion: {PROMPT!r} -> {cache_answer!r}")
    if cache_answer != disk_answer or daemon_code != 0:
        sys.exit("demo: the cached engine answered differently or the daemon did not stop cleanly")
    print(f"same answer from both; daemon stopped cleanly (logs in {work})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
