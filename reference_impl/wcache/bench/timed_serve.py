"""The engine side of the bench's engine-start measurement (start.py): `wcache serve` with its
start-up steps timed. Run as ``python -c`` by the bench, so it imports the command line (wcache.cli),
which imports the bench: a module of its own keeps that from being a loop.
"""

from __future__ import annotations

import json
import sys
import time


def serve_timed(t0: float, marks_path: str, argv: list[str]) -> int:
    """`wcache serve argv` with its start-up steps timed into ``marks_path`` (one JSON line each)."""
    marks = open(marks_path, "a", buffering=1)

    def mark(phase: str, start: float) -> None:
        marks.write(json.dumps({"phase": phase, "start": start, "end": time.monotonic()}) + "\n")

    from wcache.engine import early_context

    early_context.start(argv[argv.index("serve") + 1:])  # as wcache.cli.main does for `wcache serve`, first
    from wcache import cli
    from wcache.core import autotune
    from wcache.engine import engine, memory, runner, server  # noqa: F401  (what `wcache serve` imports)
    from wcache.model.llama import Llama

    mark("imports", t0)
    if "--device" in argv and argv[argv.index("--device") + 1] == "cuda":
        import torch

        t = time.monotonic()  # what is left of the context once imports are done
        early_context.wait()
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
