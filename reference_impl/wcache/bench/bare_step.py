"""The bare decode step: the same model's plainest decode pass with no server around it, the floor
a step of the engine is measured against (``bare_step`` in the streaming bench's record).

One pass over all layers for ``rows`` sequences, each with ``KV_LENGTH`` keys in a cache of its own
(a contiguous batch: no slots, tiles, masks or buckets), attention as one SDPA call with grouped
query heads and no mask, then the LM head and an argmax; the model's own projections, so a quantized
checkpoint multiplies as the engine does (FP8 on Hopper's tensor cores). As
shared/probes/graph_probe.py measured it on an H100 (6.06 ms at 1 row, 7.91 ms at 64, KV length 512,
2026-12-07). On a GPU the pass is a CUDA graph, replayed; on CPU it runs eagerly (no graphs there).

``python -m wcache.bench.bare_step MODEL_DIR --device cuda`` prints the JSON; the streaming bench
runs it in a process of its own after the server stopped, so that the two never share the device.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
import torch.nn.functional as F

from wcache.model import rope

KV_LENGTH = 512  # the probe's: keys each row attends over
ROWS = (1, 64)
REPLAYS = 20


@torch.inference_mode()
def plain_pass(model, ids: torch.Tensor, cache, positions: torch.Tensor) -> torch.Tensor:
    """One decode token for each row of ``ids`` (B,), written at the last position of its cache
    (per layer (B, KV_LENGTH, kv_heads, head_dim) keys and values) and attending over all of it."""
    s, B = model.shape, ids.shape[0]
    pos = cache[0][0].shape[1] - 1
    x = F.embedding(ids, model.embed.weight)  # (B, hidden)
    cos, sin = rope.cos_sin(positions, s.rope, s.head_dim, model.dtype)  # (B, 1, head_dim)
    for block, (ck, cv) in zip(model.layers.values(), cache):
        a = block.attn
        q, k, v = a.qkv(block.attn_norm(x)).split(
            [a.heads * a.head_dim, a.kv_heads * a.head_dim, a.kv_heads * a.head_dim], dim=-1)
        q = rope.apply(q.view(B, 1, a.heads, a.head_dim), cos, sin)
        ck[:, pos] = rope.apply(k.view(B, 1, a.kv_heads, a.head_dim), cos, sin)[:, 0]
        cv[:, pos] = v.view(B, a.kv_heads, a.head_dim)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), ck.transpose(1, 2), cv.transpose(1, 2),
                                             enable_gqa=True)  # (B, heads, 1, head_dim)
        x = x + a.o(out.reshape(B, a.heads * a.head_dim))
        x = x + block.mlp(block.mlp_norm(x))
    return F.linear(model.norm(x), model.lm_head.weight).argmax(-1)


def _seconds(fn, device: torch.device, runs: int) -> float:
    for _ in range(2):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t = time.perf_counter()
    for _ in range(runs):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - t) / runs


def measure(model, rows: int) -> float:
    """Seconds per bare step of ``rows`` rows: a CUDA graph's replay on a GPU, an eager pass on CPU."""
    device = model.device
    s = model.shape
    shape = (rows, KV_LENGTH, s.num_kv_heads // s.tp_size, s.head_dim)
    cache = [tuple(torch.zeros(shape, dtype=model.dtype, device=device) for _ in range(2)) for _ in s.layer_range]
    ids = torch.zeros(rows, dtype=torch.long, device=device)
    positions = torch.full((rows, 1), KV_LENGTH - 1, dtype=torch.long, device=device)
    step = lambda: plain_pass(model, ids, cache, positions)
    if device.type != "cuda":
        return _seconds(step, device, 5)
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):  # warm-up off the capture stream, as torch's docs do it
        for _ in range(2):
            step()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    seconds = _seconds(graph.replay, device, REPLAYS)
    del graph
    torch.cuda.empty_cache()
    return seconds


def run(model_dir: str, device: str, dtype: str | None) -> dict:
    from wcache.core.config import EngineConfig
    from wcache.core.disk import load_processed
    from wcache.model.llama import bind_weights, build_meta_model

    cfg = EngineConfig.build(model_dir, dtype or "auto", None, device)
    model = bind_weights(build_meta_model(cfg.shape, cfg.quant, cfg.dtype),
                         load_processed(cfg, show_progress=False).bindable())
    if cfg.device == "cpu" and cfg.dtype == torch.bfloat16:
        model.warm_rows(max(ROWS), max(ROWS))  # the projections' kernels built first, as the engine does
    out = {"mode": "CUDA graph replay" if cfg.device == "cuda" else "eager (CPU: no CUDA graphs)",
           "kv_length": KV_LENGTH, "dtype": str(cfg.dtype).removeprefix("torch."),
           "quantization": getattr(cfg.quant, "name", None) or "none"}
    for rows in ROWS:
        seconds = measure(model, rows)
        out[f"step_ms_{rows}"] = round(seconds * 1e3, 3)
        out[f"tokens_per_s_{rows}"] = round(rows / seconds, 1)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m wcache.bench.bare_step", description=__doc__.splitlines()[0])
    p.add_argument("model", help="checkpoint directory")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--dtype", help="the compute dtype (default: the checkpoint's, as wcache serve)")
    args = p.parse_args(argv)
    print(json.dumps(run(args.model, args.device, args.dtype)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
