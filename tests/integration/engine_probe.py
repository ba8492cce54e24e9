"""An engine process for the zero-copy proof: load weights like `wcache serve`, report memory.

Run as ``python engine_probe.py MODEL --load-format {safetensors,ipc_cache} [--mode zero_copy|copy]
[--socket-dir DIR] [--write]``. It reads ``/proc/self/smaps_rollup`` before and after the load and
after a forward pass that touches every weight page, and prints one JSON line. With ``--write`` it
then writes into the first weight tensor: on a read-only mapping the kernel kills it (SIGSEGV).
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
from wcache.core.config import EngineConfig
from wcache.engine.loading.registry import load_weights
from wcache.engine.loading.config import LoaderConfig
from wcache.model.llama import bind_weights, build_meta_model


def memory() -> dict[str, int]:
    """Bytes from smaps_rollup: private = Private_Clean + Private_Dirty; anon = Anonymous."""
    fields = {}
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            parts = line.split()
            if len(parts) == 3 and parts[2] == "kB":
                fields[parts[0].rstrip(":")] = int(parts[1]) * 1024
    return {"private": fields["Private_Clean"] + fields["Private_Dirty"], "anon": fields["Anonymous"],
            "rss": fields["Rss"], "shared": fields["Shared_Clean"] + fields["Shared_Dirty"]}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("--load-format", required=True, choices=["safetensors", "ipc_cache"])
    p.add_argument("--mode", default="zero_copy")
    p.add_argument("--socket-dir", default=None)
    p.add_argument("--write", action="store_true")
    args = p.parse_args()
    cfg = EngineConfig.build(args.model, "auto", None, "cpu")
    lc = LoaderConfig(mode=args.mode, fallback=False, socket_dir=args.socket_dir, state_timeout_s=30.0)
    model = build_meta_model(cfg.shape, cfg.quant, cfg.dtype)
    torch.zeros(1) + 1  # torch's own lazy allocations happen before the baseline
    before = memory()
    weights, report, lease = load_weights(cfg, args.load_format, lc)
    loaded = memory()
    bind_weights(model, weights.bindable())
    # Touch every page of every weight, as inference would.
    checksum = sum(float(t.float().sum()) for t in weights.tensors.values())
    touched = memory()
    print(json.dumps({"source": report.source, "fallback_reason": report.fallback_reason,
                      "tensors": report.tensors, "weights_bytes": weights.nbytes, "checksum": checksum,
                      "before": before, "loaded": loaded, "touched": touched}), flush=True)
    if args.write:
        name = next(iter(weights.tensors))
        weights.tensors[name].fill_(1)  # a read-only mapping: the kernel stops this with SIGSEGV
        print(json.dumps({"wrote": name}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
