"""Requests that batching must not change, shared by the CPU and GPU batching tests."""

from __future__ import annotations

import threading

from wcache.engine.worker.sampling_params import SamplingParams


def together(fn, n: int) -> list:
    """fn(i) for i in 0..n-1 on n threads released at once; their results in order."""
    out, gate = [None] * n, threading.Barrier(n)

    def run(i):
        gate.wait()
        out[i] = fn(i)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    return out


REQUESTS = [  # (prompt, max_tokens, sampling, stop): greedy and seeded, different lengths and stops
    (f"Request {i} of the batch", 20 + 7 * i,
     SamplingParams() if i % 2 else SamplingParams(0.8 + 0.05 * i, 0.9, 1000 + i),
     ("e",) if i % 3 == 0 else ())
    for i in range(12)
]
