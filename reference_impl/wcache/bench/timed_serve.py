"""The engine side of the bench's engine-start measurement (start.py): `wcache serve` with its
start-up steps timed.

The engine under test is a `wcache serve` process like any other: its program (start.py's ``_BOOT``,
run as ``python -c``) is the command line's entry point, handed to ``serve_timed`` after these timers
are in place. The bench itself never imports the command line, which sits above it (the command
line runs `wcache bench`): the two meet only in that child process, as ``python -m wcache.cli``
meets the bench's other engines.
"""

from __future__ import annotations

import json
import time


def serve_timed(t0: float, marks_path: str, argv: list[str], main) -> int:
    """`wcache serve argv`, run by ``main`` (the command line's entry point), with its start-up steps
    timed into ``marks_path`` (one JSON line each). The CUDA context is asked for first, as
    ``main`` does for `wcache serve` (engine/worker/early_context.py; asking twice starts it once)."""
    marks = open(marks_path, "a", buffering=1)

    def mark(phase: str, start: float) -> None:
        marks.write(json.dumps({"phase": phase, "start": start, "end": time.monotonic()}) + "\n")

    from wcache.engine.worker import early_context

    early_context.start(argv[argv.index("serve") + 1:])
    from wcache.core import autotune
    from wcache.engine.core import engine  # noqa: F401  (what `wcache serve` imports)
    from wcache.engine.worker import memory, runner
    from wcache.engine.api_server import server
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
    return main(argv)
