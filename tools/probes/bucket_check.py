"""GPU: the decode step at each row bucket (engine/worker/gpu_steps.py) against the bare step
(bench/bare_step.py), on a whole llama-8b of random weights, bf16 and FP8; and a row's logits the same
at 1 row and at 64. Run from the repository root on the GPU machine:

    PYTHONPATH=reference_impl:tests python3 tools/probes/bucket_check.py [bf16] [fp8]

One JSON line per model: the kernels' floors (1 everywhere: no kernel padded), whether row 0's
logits at 1, 8 and 64 rows are equal, and per bucket the engine's decode call (stage, replay, copy
out; host wall time, the GPU's time from CUDA events) next to the bare step's graph at 1 and 64 rows.
"""
import functools
import json
import sys
import time

import torch

sys.path.insert(0, "tests/gpu")
from test_row_buckets_gpu import llama_8b_layer
from wcache.bench import bare_step
from wcache.engine.worker.gpu_steps import GpuSteps

SLOTS, SLOT_LEN, POSITION = 64, 1024, 511  # keys 0..511: bucket 512, as the bare step's 512


def timed(fn, n=20):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t = time.perf_counter()
    a.record()
    for _ in range(n):
        fn()
    b.record()
    torch.cuda.synchronize()
    return round((time.perf_counter() - t) / n * 1e3, 3), round(a.elapsed_time(b) / n, 3)


def check(quant: str) -> dict:
    model = llama_8b_layer(quant, layers=32)
    cache = model.new_cache(SLOT_LEN, SLOTS)
    for k, v in cache:
        k.normal_()
        v.normal_()
    steps = GpuSteps(model, cache, SLOTS, graphs=True)
    out = {"quant": quant, "gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
           "floors": steps.floors.rows, "lengths_invariant": steps.floors.lengths_invariant}
    toks = [1000 + 37 * i for i in range(SLOTS)]
    rows0 = {}
    for rows in (1, 2, 8, 64):
        call = functools.partial(steps.decode, list(range(rows)), [POSITION] * rows, toks[:rows])
        wall, gpu = timed(call)
        rows0[rows] = call()[0]
        out[f"decode_{rows}_ms"] = {"wall": wall, "gpu": gpu, "tokens_per_s": round(rows / wall * 1e3, 1)}
    out["row0_equal_1_8_64"] = torch.equal(rows0[1], rows0[64]) and torch.equal(rows0[8], rows0[64])
    steps = cache = call = None  # the graphs and the cache go before the bare step's
    torch.cuda.empty_cache()
    for rows in (1, 64):
        s = bare_step.measure(model, rows)
        out[f"bare_{rows}_ms"] = {"wall": round(s * 1e3, 3), "tokens_per_s": round(rows / s, 1)}
    return out


if __name__ == "__main__":
    for quant in sys.argv[1:] or ["bf16", "fp8"]:
        print(json.dumps(check(quant)), flush=True)
        torch.cuda.empty_cache()
