"""`make demo`: the main job on CPU, end to end, with real processes, in about a minute.

Two models, each served from disk, then by an engine restarted on the weight cache daemon
(``--load-format ipc_cache``), each asked for one completion:

1. words: a 0.5 MiB Llama trained here, in seconds, on one sentence of the README
   (tools/sentence_model.py); it completes the sentence, the same text from disk and from the cache;
2. the ratio: the ``small`` preset (Llama shapes, about 470 MiB of seeded random weights: big enough
   that reading and post-processing it takes a visible time); its answer is arbitrary tokens
   (the tokenizer's pieces of words in no order), the same from both engines, and the
   weight load times of both engines (from their own log lines) and their ratio.

Everything lives in one temporary directory, removed at the end, on failure and on Ctrl-C too: the
checkpoints, the logs, the sockets and every cache wcache keeps (``private_caches``).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import sentence_model

from wcache.bench.api import healthy

PRESET = "small"
RANDOM_TOKENS = 12
# The engines size their KV cache for this many tokens: the prompt and the answer need far fewer
# than the preset's 2048, and the start-up's profiling pass then takes a fraction of a second.
MAX_MODEL_LEN = "160"
LOAD_LINE = re.compile(r"Loaded (\d+) tensors \(([\d.]+) MiB\) from (.+) in ([\d.]+) s")
READY = "Weight cache daemon READY"
READY_LINE = re.compile(READY + r" \((\d+ rank\(s\) in [\d.]+ s)\)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


CHILDREN: list[subprocess.Popen] = []  # every process the demo starts; main() stops those still running


def start(argv: list[str], **kw) -> subprocess.Popen:
    proc = subprocess.Popen(argv, **kw)
    CHILDREN.append(proc)
    return proc


def wcache(*args: str, log: Path) -> subprocess.Popen:
    return start([sys.executable, "-m", "wcache.cli", *args], stdout=log.open("wb"), stderr=subprocess.STDOUT)


def wait_for(predicate, proc: subprocess.Popen, log: Path, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if proc.poll() is not None or time.monotonic() > deadline:
            sys.exit(f"demo: process failed; its log:\n{log.read_text()}")
        time.sleep(0.1)


def complete(port: int, prompt: str, max_tokens: int) -> dict:
    body = json.dumps({"prompt": prompt, "max_tokens": max_tokens}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.load(r)["choices"][0]


def stop(proc: subprocess.Popen) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    return proc.wait(60)


class Served:
    """One engine's run: its weight load line, its answer, and its start to /health 200 in seconds."""

    def __init__(self, load: re.Match, answer: dict, start_s: float):
        self.load, self.answer, self.start_s = load, answer, start_s

    @property
    def load_s(self) -> float:
        return float(self.load.group(4))

    def __str__(self) -> str:
        m = self.load
        return (f"weights ready in {m.group(4)} s ({m.group(1)} tensors, {m.group(2)} MiB from {m.group(3)}); "
                f"start to /health 200: {self.start_s:.1f} s")


def serve_once(model: Path, work: Path, name: str, prompt: str, max_tokens: int, *extra: str) -> Served:
    port, log = free_port(), work / f"{name}.log"
    t0 = time.perf_counter()
    engine = wcache("serve", str(model), "--host", "127.0.0.1", "--port", str(port), "--max-model-len",
                    MAX_MODEL_LEN, *extra, log=log)
    try:
        wait_for(lambda: healthy(port), engine, log)
        start_s = time.perf_counter() - t0
        answer = complete(port, prompt, max_tokens)
    finally:
        code = stop(engine)
    if code != 0:
        sys.exit(f"demo: engine exited with {code}:\n{log.read_text()}")
    return Served(LOAD_LINE.search(log.read_text()), answer, start_s)


def from_disk_and_cache(model: Path, work: Path, prompt: str, max_tokens: int, show) -> tuple[Served, Served]:
    """An engine reading ``model`` from disk, then one mapping it from a daemon, each shown as it
    answers; the daemon is stopped before this returns, and must stop cleanly."""
    name = model.name
    disk = serve_once(model, work, f"{name}-engine-disk", prompt, max_tokens)
    show("engine from disk", disk)
    daemon_log = work / f"{name}-daemon.log"
    daemon = wcache("preload", "--model", str(model), log=daemon_log)
    try:
        wait_for(lambda: READY in daemon_log.read_text(), daemon, daemon_log)
        print(f"  weight cache daemon ready: {READY_LINE.search(daemon_log.read_text()).group(1)}")
        cache = serve_once(model, work, f"{name}-engine-cache", prompt, max_tokens, "--load-format", "ipc_cache")
        show("engine restarted with --load-format ipc_cache", cache)
    finally:
        if stop(daemon) != 0:
            sys.exit(f"demo: the daemon did not stop cleanly:\n{daemon_log.read_text()}")
    return disk, cache


def words(work: Path) -> None:
    t0 = time.perf_counter()
    model, steps = sentence_model.write(work / "sentence")
    size = sum(p.stat().st_size for p in model.iterdir()) / 2**20
    print(f"trained a {size:.1f} MiB Llama on one sentence of the README in {time.perf_counter() - t0:.1f} s "
          f"({steps} steps)")
    prompt, expected = sentence_model.PROMPT, sentence_model.completion()

    def show(title: str, s: Served) -> None:
        print(f"  {title}: {s}")
        print(f"    {prompt!r} -> {s.answer['text']!r}")

    disk, cache = from_disk_and_cache(model, work, prompt, len(expected.encode()) + 1, show)
    same = disk.answer["text"] == cache.answer["text"] == expected
    print(f"  the sentence, the same from disk and from the cache: {'yes' if same else 'NO'}")
    if not same:
        sys.exit(f"demo: expected {expected!r} from both engines")


def make_preset(work: Path) -> subprocess.Popen:
    """Writes the preset in the background while the sentence model trains and is served."""
    return start([sys.executable, "-m", "wcache.cli", "make-checkpoint", str(work / PRESET), "--preset", PRESET],
                 stdout=subprocess.DEVNULL)


def ratio(work: Path, maker: subprocess.Popen) -> None:
    if maker.wait() != 0:
        sys.exit(f"demo: make-checkpoint {PRESET} failed with exit status {maker.returncode}")
    model = work / PRESET
    size = sum(p.stat().st_size for p in model.iterdir()) / 2**20
    print(f"the {PRESET} preset: Llama layers with seeded random weights, {size:.0f} MiB; random weights answer with "
          "arbitrary tokens (pieces of words, and bytes shown as U+FFFD): what matters is that both engines give "
          "the same ones")

    def show(title: str, s: Served) -> None:
        print(f"  {title}: {s}")
        print(f"    token ids: {s.answer['token_ids']}")
        print(f"    text:      {s.answer['text']!r}")

    disk, cache = from_disk_and_cache(model, work, sentence_model.PROMPT, RANDOM_TOKENS, show)
    same = cache.answer["token_ids"] == disk.answer["token_ids"] and cache.answer["text"] == disk.answer["text"]
    print(f"  same token ids from disk and from the cache: {'yes' if same else 'NO'}")
    print(f"weights ready: {disk.load_s:.3f} s from disk, {cache.load_s:.3f} s from the cache: "
          f"{disk.load_s / max(cache.load_s, 1e-3):.0f}x faster")
    # Not "the rest costs both the same": the two starts just printed differ by more than the weights
    # (the first engine also pays for cold files and a busier machine), so say what each part is.
    print(f"start to /health 200: {disk.start_s:.1f} s from disk, {cache.start_s:.1f} s from the cache, "
          f"{disk.load_s - cache.load_s:.1f} s of the difference being the weights; the rest of a start "
          "(interpreter, torch, the HTTP server) is the same work in both engines, and varies with the "
          "machine's load and what its page cache holds")
    if not same:
        sys.exit("demo: the cached engine answered differently")


def private_caches(work: Path) -> dict[str, str]:
    """The environment that keeps every file wcache writes outside the checkpoints and sockets (the
    cache key's fingerprints, the autotune results, the activation peaks, the daemon's hand-back state)
    in the demo's own directory, so that removing it leaves nothing behind in ~/.cache or ~/.local.
    tests/integration/test_demo.py checks that this names every such variable the package reads."""
    return {"WCACHE_CACHE_ROOT": str(work / "cache"),
            "WCACHE_AUTOTUNE_CACHE_DIR": str(work / "cache" / "autotune"),
            "WCACHE_STATE_DIR": str(work / "state")}


def on_sigterm(signum, frame):
    raise KeyboardInterrupt  # the same clean-up as Ctrl-C


def main() -> int:
    signal.signal(signal.SIGTERM, on_sigterm)
    work = Path(tempfile.mkdtemp(prefix="wcache-demo-"))
    os.environ["TMPDIR"] = str(work)  # a private default socket directory for this demo
    os.environ.update(private_caches(work))  # and private caches: the demo leaves nothing behind
    t0 = time.perf_counter()
    try:
        maker = make_preset(work)
        words(work)
        ratio(work, maker)
        print(f"both daemons stopped cleanly; demo done in {time.perf_counter() - t0:.0f} s")
        return 0
    except KeyboardInterrupt:
        print("demo: interrupted", file=sys.stderr)
        return 130
    finally:
        # A Ctrl-C can land between a start and the try that stops it: stop whatever still runs.
        for proc in CHILDREN:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        shutil.rmtree(work, ignore_errors=True)  # the checkpoints (about 470 MiB) and the logs


if __name__ == "__main__":
    sys.exit(main())
