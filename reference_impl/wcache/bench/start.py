"""The restart a user lives through, for `wcache bench`: a real `wcache serve` process timed from its
spawn to the first /health 200 (a daemon restart that adopts its arena is restart.py).

The engine runs under ``python -c`` with timed_serve.py's ``serve_timed``: it notes when the interpreter
is up, imports wcache's engine, creates the CUDA context as a step of its own (a real start pays it
at its first CUDA call, inside another step), then runs the very ``wcache serve`` command with the
engine's steps wrapped by timers (``ENGINE_PHASES``). The parent polls /health from outside; what
no phase covers (HTTP server, model build, binding) is reported as ``other``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

from wcache.bench.api import free_port, healthy
from wcache.bench.failure import bench_failure
from wcache.bench.processes import quantization_flag, terminate
from wcache.bench.settings import BenchSettings

ENGINE_PHASES = ("interpreter", "imports", "cuda_context", "weights", "autotune", "activation_peak", "kv_alloc", "other")
START_TIMEOUT_S = 1800  # to /health 200, a large checkpoint read from a cold disk included
SETTLE_S = 2.0  # after a disk engine stops, before the next timed start
# The timed engine's program: the command line's own `wcache serve`, with timed_serve.py's timers.
# The context starts before the command line's modules import, as `wcache serve` starts it.
_BOOT = ("import time; T0 = time.monotonic(); import sys; from wcache.engine.worker import early_context; "
         "early_context.start(sys.argv[sys.argv.index('serve') + 1:]); from wcache.bench.timed_serve import "
         "serve_timed; from wcache.cli import main; sys.exit(serve_timed(T0, sys.argv[1], sys.argv[2:], main))")


class EngineUnderTest:
    """One `wcache serve` process (timed), from spawn to /health 200, then stopped by the caller."""

    def __init__(self, settings: BenchSettings, work: Path, load_format: str, lc=None):
        self.port = free_port()
        self.marks_path = work / f"marks-{self.port}.jsonl"
        self.log_path = work / f"engine-{self.port}.log"
        argv = ["--log-level", "INFO", "serve", settings.model, "--device", settings.device,
                "--dtype", settings.dtype,
                "--host", "127.0.0.1", "--port", str(self.port), "--load-format", load_format,
                # the bench stops what it started, and nobody routes to it: no accepting grace
                "--shutdown-delay", "0", *quantization_flag(settings.quantization)]
        if lc is not None:
            argv += ["--model-loader-extra-config", json.dumps({k: v for k, v in asdict(lc).items()
                                                                if k in ("mode", "socket_dir", "fallback")})]
        self.log = open(self.log_path, "wb")
        self.t0 = time.monotonic()
        # One process, asked for explicitly (two are the default): its start's phases are timed where
        # they run, and _BOOT's timers live in this child; a front would load in an engine core they do not see.
        env = {**os.environ, "WCACHE_ENABLE_V1_MULTIPROCESSING": "0"}
        self.proc = subprocess.Popen([sys.executable, "-c", _BOOT, str(self.marks_path), *argv],
                                     stdout=self.log, stderr=subprocess.STDOUT, env=env)
        deadline = self.t0 + START_TIMEOUT_S
        while not healthy(self.port):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                waited = START_TIMEOUT_S if self.proc.poll() is None else None
                self.stop()
                raise bench_failure(f"a {load_format} engine start", "engine", self.text(),
                                    code=self.proc.returncode, waited_s=waited)
            time.sleep(0.005)
        self.seconds = time.monotonic() - self.t0

    def text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def phases(self) -> dict:
        """Seconds per ENGINE_PHASES, from the marks the engine wrote (monotonic clock, shared)."""
        marks = [json.loads(line) for line in self.marks_path.read_text().splitlines()]
        out = dict.fromkeys(ENGINE_PHASES, 0.0)
        for m in marks:
            out[m["phase"]] += m["end"] - m["start"]
        entry = next(m["start"] for m in marks if m["phase"] == "imports")
        out["interpreter"] = entry - self.t0
        out["other"] = self.seconds - sum(v for k, v in out.items() if k != "other")
        return {k: round(v, 4) for k, v in out.items()}

    def stop(self) -> None:
        terminate(self.proc)
        self.log.close()


# The floor under any engine start on this host: a fresh interpreter that imports torch and, on a GPU,
# creates its CUDA context, and nothing else. What an engine start takes beyond it is the project's.
FLOOR_PHASES = ("interpreter", "import_torch", "cuda_context")
_FLOOR = ("import time; T0 = time.monotonic(); import json, sys; T1 = time.monotonic(); import torch; "
          "T2 = time.monotonic(); cuda = sys.argv[1] == 'cuda'; "
          "cuda and (torch.empty(1, device='cuda'), torch.cuda.synchronize()); "
          "print(json.dumps([T0, T2, time.monotonic()]))")


def start_floor(settings: BenchSettings) -> dict:
    """One floor sample: seconds from spawn to torch imported and the CUDA context made, by phase."""
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-c", _FLOOR, settings.device], capture_output=True, text=True,
                         timeout=START_TIMEOUT_S)
    if out.returncode != 0:
        raise bench_failure("the start floor (import torch, CUDA context)", "interpreter", out.stderr,
                            code=out.returncode)
    started, imported, end = json.loads(out.stdout.strip().splitlines()[-1])
    phases = dict(zip(FLOOR_PHASES, (started - t0, imported - started, end - imported)))
    return {"seconds": end - t0, "phases": phases}


def engine_start(settings: BenchSettings, work: Path, load_format: str, lc=None) -> dict:
    eng = EngineUnderTest(settings, work, load_format, lc)
    try:
        return {"seconds": eng.seconds, "phases": eng.phases()}
    finally:
        eng.stop()


def engine_starts(settings: BenchSettings, work: Path, lc, n: int) -> dict:
    """``n`` engine starts from disk and via the cache (``lc``, a daemon serving), and ``n`` floors,
    after one start that is not kept (the run's first); their summary."""
    engine_start(settings, work, "ipc_cache", lc)  # not kept: the first start of the run
    starts = {"disk": [], "ipc_cache": []}
    floor = []
    for _ in range(n):
        # The floor and the cache start side by side on a quiet host; the disk start last, then a
        # pause: the driver frees a disk engine's weights after its process has gone, and a start
        # meanwhile would pay for that.
        floor.append(start_floor(settings))
        starts["ipc_cache"].append(engine_start(settings, work, "ipc_cache", lc))
        starts["disk"].append(engine_start(settings, work, "safetensors"))
        time.sleep(SETTLE_S)
    starts["floor"] = floor
    return summary(starts)


def summary(starts: dict) -> dict:
    """Per load format (and the floor), the median engine start (to /health 200; the lower middle
    one for an even count) and that start's phases, so the phases add up to the total shown beside
    them (medians taken phase by phase would not)."""
    out = {}
    for fmt, samples in starts.items():
        median = sorted(samples, key=lambda s: s["seconds"])[(len(samples) - 1) // 2]
        out[fmt] = {"seconds": round(median["seconds"], 4),
                    "samples": [round(s["seconds"], 4) for s in samples],
                    "phases_s": {k: round(v, 4) for k, v in median["phases"].items()}}
    out["disk_over_ipc_cache"] = round(out["disk"]["seconds"] / out["ipc_cache"]["seconds"], 2)
    # What the project can still shorten: the start via the cache beyond a bare interpreter that
    # imports torch and makes its CUDA context, measured in the same run.
    out["ipc_cache_over_floor_s"] = round(out["ipc_cache"]["seconds"] - out["floor"]["seconds"], 4)
    return out
