"""``wcache bench --health-under-load``: /health latency while completions hold the engine (issue
ops-1), the health lane measured.

Starts ``wcache serve`` on ``--model`` (the CPU unless ``--device`` says otherwise), then holds 200
completion connections open (each has sent its headers and part of its body, as the issue's 70
did) and 16 streamed completions (each decoding or waiting for the engine, every one a working
slot), and probes ``GET /health`` 200 times, each on a new connection, one after the other. Prints
the latencies' p50, p99 and max and the statuses, as a line of text (and as JSON with ``--json``).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from wcache.bench.api import free_port
from wcache.bench.settings import BenchSettings


def wait_healthy(port: int, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"wcache serve exited with status {proc.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise SystemExit("wcache serve did not become healthy")


def hold(port: int, stream: bool) -> socket.socket:
    body = json.dumps({"prompt": "Hello", "max_tokens": 500, "stream": stream}).encode()
    s = socket.create_connection(("127.0.0.1", port), timeout=30)
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(body)
    s.sendall(head + (body if stream else body[:8]))  # a held one: the rest of its body never comes
    return s


def probe(port: int) -> tuple[int, float]:
    t0 = time.perf_counter()
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        data = b""
        while chunk := s.recv(1 << 16):
            data += chunk
    return int(data.split(b" ", 2)[1]), (time.perf_counter() - t0) * 1000


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


HELD, STREAMS, PROBES = 200, 16, 200


def run_bench_health(settings: BenchSettings) -> int:
    port = free_port()
    device = "cpu" if settings.device == "auto" else settings.device
    work = Path(tempfile.mkdtemp(prefix="wcache-health-"))
    log = open(work / "engine.log", "w")  # noqa: SIM115 (closed in the finally below)
    proc = subprocess.Popen([sys.executable, "-m", "wcache.cli", "serve", str(settings.model), "--device", device,
                             "--dtype", settings.dtype, "--host", "127.0.0.1", "--port", str(port),
                             "--no-enable-autotune", "--shutdown-delay", "0", "--disable-log-requests"],
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    held: list[socket.socket] = []
    try:
        wait_healthy(port, proc)
        held += [hold(port, stream=True) for _ in range(STREAMS)]
        held += [hold(port, stream=False) for _ in range(HELD)]
        time.sleep(1.0)  # every held connection accepted and waiting
        results = [probe(port) for _ in range(PROBES)]
        streaming = sum(1 for s in held[:STREAMS] if _has_answer(s))
    finally:
        for s in held:
            s.close()
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(60)
        log.close()
        shutil.rmtree(work, ignore_errors=True)
    ms = [m for _, m in results]
    statuses = {str(st): sum(1 for s, _ in results if s == st) for st in sorted({s for s, _ in results})}
    out = {"held_connections": HELD, "streams": STREAMS, "streams_answered": streaming,
           "probes": PROBES, "statuses": statuses, "p50_ms": round(statistics.median(ms), 2),
           "p99_ms": round(percentile(ms, 99), 2), "max_ms": round(max(ms), 2), "cpus": os.cpu_count()}
    print(f"/health under load: {HELD} held completion connections, {STREAMS} streams: "
          f"{PROBES} probes, statuses {statuses}, p50 {out['p50_ms']} ms, p99 {out['p99_ms']} ms, "
          f"max {out['max_ms']} ms")
    if settings.json:
        print(json.dumps(out))
    if settings.output:
        Path(settings.output).write_text(json.dumps(out, indent=2) + "\n", encoding="utf-8")
    return 0 if statuses == {"200": PROBES} else 1


def _has_answer(s: socket.socket) -> bool:
    """The stream got its 200 head (it holds a working slot)."""
    s.settimeout(0.5)
    try:
        return s.recv(1 << 16).startswith(b"HTTP/1.1 200 ")
    except OSError:
        return False

