"""Row buckets on a GPU (engine/worker/gpu_steps.py, engine/worker/row_floors.py): a row's logits are the same bit
for bit whether its decode step runs at 1, 2, 4, ... or 64 rows and over a short or a long key
bucket, through the eager passes and the CUDA graphs, on llama-8b's shapes in bfloat16 and in FP8
(one layer of random weights: the kernels are chosen by shape, not by values or depth; about 1.5 GB).

These fail whenever a kernel of the decode pass sums a row differently at another row count and
row_floors.py did not pad it (as a bucket without the floors would on such a device)."""

from __future__ import annotations

import json

import pytest
import torch
from wcache.engine.worker import row_floors
from wcache.engine.worker.gpu_steps import GpuSteps
from wcache.model import fp8, rope
from wcache.model.llama import ModelShape, bind_weights, build_meta_model
from wcache.model.quant import Fp8BlockCheckpoint, QuantMethod

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability(0) >= (9, 0)
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device; run `make test-gpu` on one"),
]
SLOTS, SLOT_LEN = 64, 1024


def llama_8b_layer(quant: str, layers: int = 1):
    """One llama-8b layer (or ``layers``: tools/probes/bucket_check.py), its LM head and norms, random
    weights; the embedding a strided window over a few kilobytes (distinct rows, no 1 GB table)."""
    shape = ModelShape(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=layers, num_heads=32,
                       num_kv_heads=8, head_dim=128, rope=rope.Rope.from_parameters({"rope_theta": 500000.0}),
                       rms_norm_eps=1e-5, max_positions=8192, tie_embeddings=False)
    method = (Fp8BlockCheckpoint({"quant_method": "fp8", "weight_block_size": [128, 128]}) if quant == "fp8"
              else QuantMethod())
    model = build_meta_model(shape, method, torch.bfloat16)
    g = torch.Generator(device="cuda").manual_seed(0)
    tensors = {}
    for name, b in model.named_buffers():
        if name == "embed.weight":
            base = torch.randn(b.shape[0] + b.shape[1], generator=g, device="cuda").to(b.dtype)
            tensors[name] = base.as_strided(b.shape, (1, 1))
        elif b.dtype == fp8.FP8:
            tensors[name] = (torch.randn(b.shape, generator=g, device="cuda") * 100).clamp(-448, 448).to(fp8.FP8)
        elif name.endswith("weight_scale_inv"):
            tensors[name] = torch.rand(b.shape, generator=g, device="cuda") * 2e-4 + 1e-4
        elif b.dim() == 1:
            tensors[name] = 1 + 0.1 * torch.randn(b.shape, generator=g, device="cuda").to(b.dtype)
        else:
            tensors[name] = (torch.randn(b.shape, generator=g, device="cuda") * 0.02).to(b.dtype)
    return bind_weights(model, tensors)


QUANTS = ["bf16", pytest.param("fp8", marks=pytest.mark.skipif(not HOPPER, reason="FP8 tensor cores: Hopper"))]


@pytest.mark.parametrize("quant", QUANTS)
def test_a_rows_logits_are_the_same_at_every_row_bucket_and_key_bucket(quant):
    model = llama_8b_layer(quant)
    cache = model.new_cache(SLOT_LEN, SLOTS)
    for k, v in cache:  # keys already there: attention reads real values
        k.normal_()
        v.normal_()
    steps = GpuSteps(model, cache, SLOTS, graphs=True)
    floors = steps.floors
    print(json.dumps({"quant": quant, "floors": floors.rows, "lengths_invariant": floors.lengths_invariant}))
    starts = [60 + 11 * i for i in range(SLOTS)]  # slot 0 alone: keys bucket 64; all 64: 1024
    tokens = [1000 + 37 * i for i in range(SLOTS)]

    def decode(slots):  # twice eager, then captured and replayed: all four the same
        outs = [steps.decode(slots, [starts[s] for s in slots], [tokens[s] for s in slots]) for _ in range(4)]
        assert all(torch.equal(o, outs[0]) for o in outs[1:]), "a graph's replay differs from the eager pass"
        return outs[0]

    full = decode(list(range(SLOTS)))
    assert steps.last_rows == SLOTS
    for b in row_floors.buckets(SLOTS)[:-1]:
        out = decode(list(range(b)))
        assert steps.last_rows == b
        same = [i for i in range(b) if torch.equal(out[i], full[i])]
        assert len(same) == b, f"{quant}: at {b} rows, rows {sorted(set(range(b)) - set(same))} differ from 64 rows"
    lone = decode([5])  # slot 5 alone: the tile's first 8 slots, 3 of them idle
    assert steps.last_rows == 8 and torch.equal(lone[0], full[5])
    assert {(0, b) for b in row_floors.buckets(SLOTS)} <= {key[1:3] for key in steps._captured}

