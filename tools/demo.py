"""`make demo`: the main job on CPU, end to end, with real processes, in about a minute.

1. make the `small` preset (Llama shapes, about 470 MiB in bfloat16: big enough that reading and
   post-processing it takes a visible time); 2. serve it from disk and ask for one completion;
3. start the weight cache daemon, restart the engine with ``--load-format ipc_cache`` and ask
   again; 4. print both engines' weight load times (from their own log lines), their ratio, and both
   answers as token ids and as text, which must be identical. The weights are seeded random numbers,
   so the answer is arbitrary tokens: the tokenizer shows bytes that do not print as ``\\xNN`` and ids
   it gives no text as ``<id>``, never a replacement character.
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
MAX_TOKENS = 12
PRESET = "small"
# The engines size their KV cache for this many tokens: the prompt and the answer need far fewer
# than the preset's 2048, and the start-up's profiling pass then takes a fraction of a second.
MAX_MODEL_LEN = "128"
LOAD_LINE = re.compile(r"Loaded (\d+) tensors \(([\d.]+) MiB\) from (.+) in ([\d.]+) s")
READY_LINE = re.compile(r"Weight cache daemon READY \(.*\)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wcache(*args: str, log: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "wcache.cli", *args], stdout=log.open("wb"),
                            stderr=subprocess.STDOUT)


def wait_for(predicate, proc: subprocess.Popen, log: Path, timeout: float = 300.0) -> None:
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


def complete(port: int) -> dict:
    body = json.dumps({"prompt": PROMPT, "max_tokens": MAX_TOKENS}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.load(r)["choices"][0]


def stop(proc: subprocess.Popen) -> int:
    proc.send_signal(signal.SIGTERM)
    return proc.wait(60)


def serve_once(model: Path, work: Path, name: str, *extra: str) -> tuple[re.Match, dict]:
    port, log = free_port(), work / f"{name}.log"
    engine = wcache("serve", str(model), "--host", "127.0.0.1", "--port", str(port), "--max-model-len",
                    MAX_MODEL_LEN, *extra, log=log)
    try:
        wait_for(lambda: healthy(port), engine, log)
        answer = complete(port)
    finally:
        code = stop(engine)
    if code != 0:
        sys.exit(f"demo: engine exited with {code}:\n{log.read_text()}")
    return LOAD_LINE.search(log.read_text()), answer


def show(title: str, load: re.Match, answer: dict) -> None:
    print(f"{title}: weights ready in {load.group(4)} s ({load.group(1)} tensors, {load.group(2)} MiB "
          f"from {load.group(3)})")
    print(f"  completion of {PROMPT!r}, {len(answer['token_ids'])} tokens:")
    print(f"    token ids: {answer['token_ids']}")
    print(f"    text:      {answer['text']!r}")


def main() -> int:
    work = Path(tempfile.mkdtemp(prefix="wcache-demo-"))
    os.environ["TMPDIR"] = str(work)  # a private default socket directory for this demo
    model = work / PRESET
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "wcache.cli", "make-checkpoint", str(model), "--preset", PRESET],
                   check=True, stdout=subprocess.DEVNULL)
    size = sum(p.stat().st_size for p in model.iterdir()) / 2**20
    print(f"made the {PRESET} preset (Llama layers with seeded random weights, {size:.0f} MiB) in "
          f"{time.perf_counter() - t0:.1f} s")
    print("random weights answer with arbitrary tokens (text shows bytes that do not print as \\xNN, and ids "
          "without text as <id>): what matters is that both engines give the same ones")

    disk_load, disk_answer = serve_once(model, work, "engine-disk")
    show("engine from disk", disk_load, disk_answer)

    daemon_log = work / "daemon.log"
    daemon = wcache("preload", "--model", str(model), log=daemon_log)
    wait_for(lambda: "Weight cache daemon READY" in daemon_log.read_text(), daemon, daemon_log)
    print(f"weight cache daemon: {READY_LINE.search(daemon_log.read_text()).group(0)}")
    try:
        cache_load, cache_answer = serve_once(model, work, "engine-cache", "--load-format", "ipc_cache")
    finally:
        daemon_code = stop(daemon)
    show("engine restarted with --load-format ipc_cache", cache_load, cache_answer)

    same = cache_answer["token_ids"] == disk_answer["token_ids"] and cache_answer["text"] == disk_answer["text"]
    disk_s, cache_s = float(disk_load.group(4)), float(cache_load.group(4))
    print(f"same token ids from disk and from the cache: {'yes' if same else 'NO'}")
    print(f"weights ready: {disk_s:.3f} s from disk, {cache_s:.3f} s from the cache: "
          f"{disk_s / max(cache_s, 1e-3):.0f}x faster")
    if not same or daemon_code != 0:
        sys.exit("demo: the cached engine answered differently or the daemon did not stop cleanly")
    print(f"daemon stopped cleanly (logs in {work})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
