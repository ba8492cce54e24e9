"""The restart a user lives through, for `wcache bench`: a real `wcache serve` process timed from its
spawn to the first /health 200 (a daemon restart that adopts its arena is bench_restart.py).

The engine runs under ``python -c`` with this module's ``serve_timed``: it notes when the interpreter
is up, imports wcache's engine, creates the CUDA context as a step of its own (a real start pays it
at its first CUDA call, inside another step), then runs the very ``wcache serve`` command with the
engine's steps wrapped by timers (``ENGINE_PHASES``). The parent polls /health from outside; what
no phase covers (HTTP server, model build, binding) is reported as ``other``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import asdict
from pathlib import Path

from wcache.errors import BenchError

ENGINE_PHASES = ("interpreter", "imports", "cuda_context", "weights", "autotune", "activation_peak", "kv_alloc", "other")
_BOOT = ("import time; T0 = time.monotonic(); import json, sys; from wcache.bench_start import serve_timed; "
         "serve_timed(T0, sys.argv[1], sys.argv[2:])")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
            return r.status == 200
    except OSError:
        return False


class EngineUnderTest:
    """One `wcache serve` process (timed), from spawn to /health 200, then stopped by the caller."""

    def __init__(self, args, work: Path, load_format: str, lc=None):
        self.port = _free_port()
        self.marks_path = work / f"marks-{self.port}.jsonl"
        self.log_path = work / f"engine-{self.port}.log"
        argv = ["--log-level", "INFO", "serve", args.model, "--device", args.device, "--dtype", args.dtype,
                "--host", "127.0.0.1", "--port", str(self.port), "--load-format", load_format]
        if lc is not None:
            argv += ["--model-loader-extra-config", json.dumps({k: v for k, v in asdict(lc).items()
                                                                if k in ("mode", "socket_dir", "fallback")})]
        self.log = open(self.log_path, "wb")
        self.t0 = time.monotonic()
        self.proc = subprocess.Popen([sys.executable, "-c", _BOOT, str(self.marks_path), *argv],
                                     stdout=self.log, stderr=subprocess.STDOUT)
        deadline = self.t0 + 1800
        while not _healthy(self.port):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                from wcache.bench import _log_tail

                _log_tail("engine", self.text())
                raise BenchError(BenchError.SAMPLE.format(what=f"a {load_format} engine start",
                                                          code=self.proc.returncode))
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
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def engine_start(args, work: Path, load_format: str, lc=None) -> dict:
    eng = EngineUnderTest(args, work, load_format, lc)
    try:
        return {"seconds": eng.seconds, "phases": eng.phases()}
    finally:
        eng.stop()


def serve_timed(t0: float, marks_path: str, argv: list[str]) -> int:
    """`wcache serve argv` with its start-up steps timed into ``marks_path`` (one JSON line each)."""
    marks = open(marks_path, "a", buffering=1)

    def mark(phase: str, start: float) -> None:
        marks.write(json.dumps({"phase": phase, "start": start, "end": time.monotonic()}) + "\n")

    from wcache import cli
    from wcache.core import autotune
    from wcache.engine import engine, memory, runner, server  # noqa: F401  (what `wcache serve` imports)
    from wcache.model.llama import Llama

    mark("imports", t0)
    if "--device" in argv and argv[argv.index("--device") + 1] == "cuda":
        import torch

        t = time.monotonic()
        torch.empty(1, device="cuda")
        torch.cuda.synchronize()
        mark("cuda_context", t)

    in_measure = []

    def timed(phase, fn, skip_inside_measure=False):
        def run(*a, **kw):
            if skip_inside_measure and in_measure:
                return fn(*a, **kw)
            t = time.monotonic()
            if phase == "activation_peak":
                in_measure.append(1)
            try:
                return fn(*a, **kw)
            finally:
                if phase == "activation_peak":
                    in_measure.pop()
                mark(phase, t)
        return run

    runner.load_weights = timed("weights", runner.load_weights)
    autotune.prepare_engine = timed("autotune", autotune.prepare_engine)
    memory.measure_activation_peak = timed("activation_peak", memory.measure_activation_peak)
    Llama.new_cache = timed("kv_alloc", Llama.new_cache, skip_inside_measure=True)
    sys.exit(cli.main(argv))
