"""The handoff, for `wcache bench`: "weights ready" from disk, and from the weight cache in zero_copy
and copy mode, each sample timed in a fresh process.

"Weights ready" is what an engine restart waits for before it can bind its model: for disk, read
the shards and post-process; for the cache, compute the key, ask the daemon and bind views (copy
mode also clones). ``python -m wcache.bench.handoff SPEC`` is one sample (``sample_in_fresh_process``
runs it).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import asdict

import torch

from wcache.bench.failure import bench_failure
from wcache.bench.settings import BenchSettings
from wcache.core.config import EngineConfig
from wcache.engine.loading.config import LoaderConfig
from wcache.engine.loading.registry import load_weights


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _timed_load(cfg, load_format, lc=None) -> tuple[float, object]:
    _sync(cfg.device)
    t0 = time.perf_counter()
    loaded = load_weights(cfg, load_format, lc)
    _sync(cfg.device)
    elapsed = time.perf_counter() - t0
    if loaded.report.fallback_reason:
        raise RuntimeError(f"bench expected the weight cache but the loader fell back: {loaded.report.fallback_reason}")
    return elapsed, loaded


def _warm_device(cfg) -> None:
    """A restarted engine creates its CUDA context whatever the weights' source: keep that out of
    every sample alike."""
    if cfg.device == "cuda":
        from wcache.wire.transports.cuda_ipc import cudart

        torch.empty(1, device=cfg.torch_device)
        cudart()


def sample_in_fresh_process(settings: BenchSettings, load_format: str, lc: LoaderConfig | None = None) -> dict:
    """One timed load in a new interpreter, as an engine restart does it: the page cache is warm,
    but the process (its allocator, its mappings) is new. Timing starts inside, after imports."""
    spec = {"model": settings.model, "dtype": settings.dtype, "quantization": settings.quantization,
            "device": settings.device, "load_format": load_format,
            "loader": asdict(lc) if lc else None}
    out = subprocess.run([sys.executable, "-m", "wcache.bench.handoff", json.dumps(spec)], capture_output=True,
                         text=True, timeout=1800)
    if out.returncode != 0:
        raise bench_failure(f"a {load_format} sample", "sample", out.stderr, code=out.returncode)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _sample_main(spec: dict) -> None:
    from wcache.core import disk  # noqa: F401
    from wcache.engine.loading import ipc_cache  # noqa: F401  (imports are process start-up, outside every sample)

    cfg = EngineConfig.build(spec["model"], spec["dtype"], spec["quantization"], spec["device"])
    _warm_device(cfg)
    lc = LoaderConfig(**spec["loader"]) if spec["loader"] else None
    elapsed, (_weights, report, _lease) = _timed_load(cfg, spec["load_format"], lc)
    print(json.dumps({"seconds": elapsed, "phases": report.phases, "tensors": report.tensors,
                      "nbytes": report.nbytes, "transport": report.transport}))


if __name__ == "__main__":  # one sample, for sample_in_fresh_process
    _sample_main(json.loads(sys.argv[1]))
