"""H200: the tiled decoder against the model's batch path; lone vs batch invariance; step times."""
Run on the H200 from tools/probes with PYTHONPATH=../../reference_impl (2026-12-04: driver 580.159.04, torch 2.11.0+cu130).
import json, time, torch
import torch.nn.functional as F
from wcache.model import rope
from wcache.model.llama import ModelShape, build_meta_model, bind_weights
from wcache.model import quant as qm
from wcache.engine.worker import gpu_steps
from wcache.engine.worker.gpu_steps import GpuSteps as TiledDecoder
dev, dt = "cuda", torch.bfloat16
torch.manual_seed(0)
R = {}
def timeit(fn, n=20):
    for _ in range(3): fn()
    torch.cuda.synchronize(); t = time.perf_counter()
    for _ in range(n): fn()
    torch.cuda.synchronize(); return round((time.perf_counter() - t) / n * 1000, 3)
shape = ModelShape(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32, num_kv_heads=8,
                   head_dim=128, rope=rope.Rope.from_parameters({"rope_theta": 500000.0}), rms_norm_eps=1e-5,
                   max_positions=8192, tie_embeddings=False)
model = build_meta_model(shape, qm.QuantMethod(), dt)
bind_weights(model, {n: (torch.randn(b.shape, device=dev, dtype=dt) * 0.02 if b.dim() > 1 else torch.ones(b.shape, device=dev, dtype=dt))
                     for n, b in model.named_buffers()})
R["pool_bytes"] = gpu_steps.pool_bytes(model, 256, 2048)
NS, SL = 128, 1024
cache = model.new_cache(SL, NS)
# prefill 100 sequences with random prompts of varying length, one per pass (flash path)
lens = [20 + 7 * i for i in range(100)]
prompts = [torch.randint(0, 1000, (n,), device=dev) for n in lens]
with torch.inference_mode():
    t0 = time.perf_counter()
    first = [model(p, 0, cache, slots=[i]) for i, p in enumerate(prompts)]
    torch.cuda.synchronize(); R["prefill_100_alone_ms_each"] = round((time.perf_counter() - t0) * 10, 2)
    # old masked prefill path for comparison of values (slot 127 scratch)
    from wcache.model import llama
    b = llama.Batch([0], lens[5], [127], dev, SL); b.from_zero = False
    keys = torch.arange(lens[5], device=dev); b.mask = (keys[None, None, :] <= b.positions[:, :, None])[:, None]
    R["prefill_flash_vs_masked_maxdiff"] = "skipped"
    dec = TiledDecoder(model, cache, NS, graphs=True)
    slots = list(range(100)); starts = lens[:]; toks = [int(f.argmax()) for f in first]
    # reference: old batch path (model.forward) on a copy of the cache
    import copy
    cache2 = [(k.clone(), v.clone()) for k, v in cache]
    ref = model(torch.tensor(toks, device=dev).view(100, 1), starts, cache2, slots=slots)
    del cache2
    out = dec.decode(slots, starts, toks)
    R["tiled_vs_batch_path_maxdiff"] = float((out - ref).abs().max())
    R["tiled_vs_batch_path_argmax_same"] = int((out.argmax(-1) == ref.argmax(-1)).sum())
    # invariance: slot 3 alone at its next position vs in the full batch (fresh cache copies)
    snap = [(k.clone(), v.clone()) for k, v in cache]
    def restore():
        for (k, v), (k0, v0) in zip(cache, snap): k.copy_(k0); v.copy_(v0)
    restore(); full = dec.decode(slots, starts, toks)
    restore(); lone = dec.decode([3], [starts[3]], [toks[3]])
    restore(); pair = dec.decode([3, 90], [starts[3], starts[90]], [toks[3], toks[90]])
    R["slot3_lone_equals_batch"] = bool(torch.equal(lone[0], full[3]))
    R["slot3_pair_equals_batch"] = bool(torch.equal(pair[0], full[3]))
    R["slot90_pair_equals_batch"] = bool(torch.equal(pair[1], full[90]))
    # 20 steps greedy, slot 3 alone vs in the batch: tokens equal
    def run(sl, steps=20):
        restore(); st = [starts[s] for s in sl]; tk = [toks[s] for s in sl]; hist = []
        for _ in range(steps):
            lg = dec.decode(sl, st, tk); tk = lg.argmax(-1).tolist(); st = [x + 1 for x in st]; hist.append(tk)
        return hist
    h_full = run(slots); h_lone = run([3])
    R["greedy20_slot3_same"] = [r[3] for r in h_full] == [r[0] for r in h_lone]
    R["captured_graphs"] = len(dec._captured)
    restore()
    for B in (1, 8, 64, 100):
        sl = slots[:B]
        R[f"step_graph_B{B}_ms"] = timeit(lambda: dec.decode(sl, [500] * B, toks[:B]))
    eager = TiledDecoder(model, cache, NS, graphs=False)
    for B in (1, 64):
        R[f"step_eager_B{B}_ms"] = timeit(lambda: eager.decode(slots[:B], [500] * B, toks[:B]))
    # prompts: graph vs eager alone, lone equals in-graph; timing
    for n in (6, 100, 300):
        p = prompts[0][:1].repeat(n) if n > len(prompts[0]) else prompts[0][:n]
        p = torch.randint(0, 1000, (n,), device=dev)
        ref = model(p, 0, cache, slots=[120])
        outs = [dec.prompt(120, p.tolist()) for _ in range(4)]
        R[f"prompt{n}_graph_equals_eager_runs"] = all(torch.equal(o, outs[0]) for o in outs)
        R[f"prompt{n}_vs_unpadded_maxdiff"] = float((outs[0][0] - ref).abs().max())
        R[f"prompt{n}_graph_ms"] = timeit(lambda: dec.prompt(120, p.tolist()))
        R[f"prompt{n}_eager_ms"] = timeit(lambda: model(p, 0, cache, slots=[120]))
    R["reserved_gib"] = round(torch.cuda.memory_reserved() / 2**30, 2)
print(json.dumps(R), flush=True)
