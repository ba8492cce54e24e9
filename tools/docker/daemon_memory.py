"""The weight cache daemon's host memory while it serves: the figure the deployment files' memory
limits are sized from (docs/kubernetes.md, "How much memory").

Starts `wcache preload` on a checkpoint, waits for READY, then reads every process of the daemon
(launcher and ranks) from /proc: resident memory now (VmRSS) and its peak (VmHWM, which covers the
load), and, sampled every 0.2 s during the load, the peak of each kind: anonymous memory (what a
limit must hold), file pages (the checkpoint's page cache, which the kernel reclaims before it
kills) and shared memory. Writes one JSON record. Run it where the daemon will run, e.g. on the GPU host:

    python3 -m wcache.cli make-checkpoint /tmp/l8 --preset llama-8b
    python3 tools/docker/daemon_memory.py --model /tmp/l8 --device cuda --output daemon-memory.json

The sum over processes counts pages that processes share (the interpreter's libraries) once per
process, as a container's memory accounting does not: it overstates, which is the safe side for a
limit.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

READY = "Weight cache daemon READY"


def children(pid: int) -> list[int]:
    out = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                if int((p / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    out.append(int(p.name))
            except (OSError, IndexError, ValueError):
                pass
    return out


def tree(pid: int) -> list[int]:
    todo, seen = [pid], []
    while todo:
        p = todo.pop()
        seen.append(p)
        todo += children(p)
    return seen


def status_kib(pid: int) -> dict[str, int]:
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem"):
            out[key] = int(value.split()[0])
    return out


def environment(device: str) -> dict:
    env = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "python": sys.version.split()[0], "device": device, "commit": os.environ.get("WCACHE_COMMIT", "")}
    import torch

    env["torch"] = torch.__version__
    if device == "cuda":
        q = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                           capture_output=True, text=True)
        env["gpu"], env["driver"] = [x.strip() for x in q.stdout.splitlines()[0].split(",")]
    return env


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--transport", default="vmm_fd")
    ap.add_argument("--health-port", type=int, default=9601)
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--output", required=True)
    args = ap.parse_args()
    log = Path(args.output).with_suffix(".log")
    argv = [sys.executable, "-m", "wcache.cli", "preload", "--model", args.model, "--device", args.device,
            "--weight-cache-transport", args.transport, "--weight-cache-health-port", str(args.health_port),
            "--weight-cache-health-host", "127.0.0.1"]
    t0 = time.monotonic()
    with log.open("w") as f:
        proc = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT)
    peaks = {"RssAnon": 0, "RssFile": 0, "RssShmem": 0}
    try:
        while READY not in log.read_text(errors="replace"):
            if proc.poll() is not None or time.monotonic() - t0 > args.timeout:
                print(log.read_text(errors="replace")[-4000:], file=sys.stderr)
                return 1
            now = {k: 0 for k in peaks}
            for pid in tree(proc.pid):
                try:
                    st = status_kib(pid)
                except OSError:
                    continue
                for k in now:
                    now[k] += st.get(k, 0)
            peaks = {k: max(peaks[k], now[k]) for k in peaks}
            time.sleep(0.2)
        ready_s = time.monotonic() - t0
        time.sleep(5)  # settled: what it holds while serving
        processes = []
        for pid in tree(proc.pid):
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ").strip()
                processes.append({"pid": pid, "cmd": cmd[:200], **status_kib(pid)})
            except OSError:
                pass
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
    model_bytes = sum(p.stat().st_size for p in Path(args.model).glob("*.safetensors"))
    record = {"environment": environment(args.device), "model": {"path": args.model, "bytes": model_bytes},
              "transport": args.transport, "ready_s": round(ready_s, 2), "processes": processes,
              "rss_mib": round(sum(p["VmRSS"] for p in processes) / 1024, 1),
              "peak_rss_mib": round(sum(p["VmHWM"] for p in processes) / 1024, 1),
              "load_peaks_mib": {k: round(v / 1024, 1) for k, v in peaks.items()},
              "serving_mib": {k: round(sum(p.get(k, 0) for p in processes) / 1024, 1)
                              for k in ("RssAnon", "RssFile", "RssShmem")}}
    Path(args.output).write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps({k: record[k] for k in ("rss_mib", "peak_rss_mib", "load_peaks_mib", "serving_mib", "ready_s")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
