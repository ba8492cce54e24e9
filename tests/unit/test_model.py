"""The model against an independent reference, TP slicing, int8, and the methods known by name and
refused (FP8 has its own file, test_fp8.py)."""

from __future__ import annotations

import math
import threading

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from wcache.core.checkpoint_files import read_config, shard_files
from wcache.core.config import EngineConfig, Ranks
from wcache.core.disk import load_processed
from wcache.model.llama import (
    BindError,
    ModelShape,
    bind_weights,
    build_meta_model,
    generate,
    padded_rows,
    row_sizes,
)
from wcache.core.postprocess import fused_gate_up, fused_qkv, split_cols, split_rows
from wcache.errors import UnsupportedQuantForIPCError
from wcache.model.quant import (
    CHOICES,
    METHODS,
    Fp8Online,
    Int8WeightOnly,
    QuantizationError,
    QuantMethod,
    Refused,
    refuse_for_cache,
    resolve,
)

PROMPT = [256, 72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100]  # BOS "Hello, world"


def raw_tensors(model_dir) -> dict[str, torch.Tensor]:
    out = {}
    for f in shard_files(model_dir):
        out.update(load_file(str(f)))
    return out


def reference_logits(raw: dict[str, torch.Tensor], cfg: dict, ids: list[int]) -> torch.Tensor:
    """Logits at every position, from the Hugging Face tensors with plain float64 torch ops:
    unfused q/k/v and gate/up, explicit per-head causal softmax attention, rotate-half RoPE."""
    w = {k: v.double() for k, v in raw.items()}
    h, heads, kv_heads = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd, eps, T = h // heads, cfg["rms_norm_eps"], len(ids)
    inv_freq = 1.0 / cfg["rope_theta"] ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    angles = torch.arange(T, dtype=torch.float64)[:, None] * inv_freq[None, :]
    cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]

    def rope(t):  # [T, heads, hd]: rotate the pairs (i, i + hd/2)
        a, b = t[..., : hd // 2], t[..., hd // 2 :]
        return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)

    def rms(x, g):
        return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * g

    causal = torch.ones(T, T, dtype=torch.bool).triu(1)
    x = w["model.embed_tokens.weight"][torch.tensor(ids)]
    for n in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{n}."
        a = rms(x, w[p + "input_layernorm.weight"])
        q = rope((a @ w[p + "self_attn.q_proj.weight"].T).view(T, heads, hd))
        k = rope((a @ w[p + "self_attn.k_proj.weight"].T).view(T, kv_heads, hd))
        v = (a @ w[p + "self_attn.v_proj.weight"].T).view(T, kv_heads, hd)
        out = torch.empty(T, heads, hd, dtype=torch.float64)
        for head in range(heads):
            kv = head // (heads // kv_heads)
            scores = (q[:, head] @ k[:, kv].T / math.sqrt(hd)).masked_fill(causal, float("-inf"))
            out[:, head] = torch.softmax(scores, dim=-1) @ v[:, kv]
        x = x + out.reshape(T, h) @ w[p + "self_attn.o_proj.weight"].T
        m = rms(x, w[p + "post_attention_layernorm.weight"])
        gate, up = m @ w[p + "mlp.gate_proj.weight"].T, m @ w[p + "mlp.up_proj.weight"].T
        x = x + (gate * torch.sigmoid(gate) * up) @ w[p + "mlp.down_proj.weight"].T
    x = rms(x, w["model.norm.weight"])
    return x @ w.get("lm_head.weight", w["model.embed_tokens.weight"]).T


def build(model_dir, dtype="float32", quantization=None, ranks=None):
    cfg = EngineConfig.build(str(model_dir), dtype, quantization, "cpu", ranks=ranks or Ranks())
    weights = load_processed(cfg, show_progress=False)
    return bind_weights(build_meta_model(cfg.shape, cfg.quant, cfg.dtype), weights.bindable()), weights


def assert_close(actual: torch.Tensor, expected: torch.Tensor, rel: float) -> None:
    err = (actual.double() - expected.double()).abs().max().item()
    scale = expected.abs().max().item()
    assert err <= rel * scale, f"max |diff| {err:.3g} exceeds {rel:g} x max |logit| {scale:.3g}"


@pytest.mark.parametrize("fixture", ["tiny_model", "tiny_tied_model"])
def test_forward_equals_reference(request, fixture):
    model_dir = request.getfixturevalue(fixture)
    model, _ = build(model_dir)
    expected = reference_logits(raw_tensors(model_dir), read_config(model_dir), PROMPT)
    logits = model(torch.tensor(PROMPT), 0, model.new_cache(len(PROMPT)))
    assert logits.shape == (512,)
    assert_close(logits, expected[-1], 1e-5)


def test_kv_cache_decoding_equals_reference_on_the_full_prefix(tiny_model):
    model, _ = build(tiny_model)
    expected = reference_logits(raw_tensors(tiny_model), read_config(tiny_model), PROMPT)
    cache = model.new_cache(len(PROMPT))
    assert_close(model(torch.tensor(PROMPT[:5]), 0, cache), expected[4], 1e-5)
    for pos in range(5, len(PROMPT)):  # one token at a time against the cached keys/values
        assert_close(model(torch.tensor([PROMPT[pos]]), pos, cache), expected[pos], 1e-5)


def test_generate_is_greedy_over_the_reference(tiny_model):
    model, _ = build(tiny_model)
    raw, cfg = raw_tensors(tiny_model), read_config(tiny_model)
    out = generate(model, PROMPT, 4)
    ids = list(PROMPT)
    for _ in range(4):
        ids.append(int(reference_logits(raw, cfg, ids)[-1].argmax()))
    assert out == ids[len(PROMPT):]



@pytest.mark.parametrize("length", [5, 33, 300])  # 300: several of the CPU kernel's query blocks
def test_prompts_of_one_length_in_one_pass_give_each_row_its_logits_alone(tiny_model, length):
    """CPU prompts of one length attend in one call (llama.Attention, from position 0): each row's
    logits must equal, bit for bit, the same prompt run alone, or a batch would change a request's
    tokens. In bfloat16, the presets' dtype; float32's matrix products round differently for more
    rows, so a float32 CPU engine runs each prompt alone (engine.py, row_by_row)."""
    gen = torch.Generator().manual_seed(length)
    prompts = torch.randint(0, 500, (6, length), generator=gen)
    model, _ = build(tiny_model, "bfloat16")
    cache = model.new_cache(length, num_seqs=7)
    together = model(prompts, [0] * 6, cache, slots=[1, 2, 3, 4, 5, 6])
    alone = torch.cat([model(p, [0], cache, slots=[0]) for p in prompts])
    assert together.shape == alone.shape == (6, 512)
    assert torch.equal(together, alone)

def test_row_counts_are_padded_to_few_sizes():
    assert [padded_rows(n) for n in (1, 2, 3, 5, 9, 33, 64, 65, 96, 129, 500)] == [
        1, 2, 4, 8, 16, 64, 64, 128, 128, 192, 512]
    assert row_sizes(512) == [1, 2, 4, 8, 16, 32, 64, 128, 192, 256, 320, 384, 448, 512]
    assert row_sizes(5) == [1, 2, 4, 8]  # every count up to 5 pads to one of these


@pytest.mark.parametrize("rows", [1, 3, 7, 16, 17])
def test_padded_rows_change_no_logit(tiny_model, rows):
    """A CPU bfloat16 model pads each projection's rows to a few sizes built at start
    (Llama.warm_rows): padding must not change a bit of any row's logits, in a prompt pass (rows
    prompts of 5 tokens: 5 x rows projection rows) or in a decode step (rows rows)."""
    gen = torch.Generator().manual_seed(rows)
    prompts = torch.randint(0, 500, (rows, 5), generator=gen)
    plain, _ = build(tiny_model, "bfloat16")
    padded, _ = build(tiny_model, "bfloat16")
    assert padded.warm_rows(64, 64) == 64  # the tiny preset pads every count (llama.PAD_MACS)
    for model in (plain, padded):
        cache = model.new_cache(8, num_seqs=rows)
        model.out = [model(prompts, [0] * rows, cache), model(prompts[:, :1], [5] * rows, cache)]
    assert padded.pad_limit == 64 and not plain.pad_limit
    for a, b in zip(plain.out, padded.out):
        assert torch.equal(a, b)


# -- tensor-parallel slicing -----------------------------------------------------------------------

@pytest.mark.parametrize("size", [1, 2, 4])
def test_split_rows_and_cols_round_trip(size):
    w = torch.randn(8, 12)
    rows = [split_rows(w, r, size) for r in range(size)]
    cols = [split_cols(w, r, size) for r in range(size)]
    assert all(t.shape == (8 // size, 12) for t in rows) and all(t.shape == (8, 12 // size) for t in cols)
    assert torch.equal(torch.cat(rows, dim=0), w)
    assert torch.equal(torch.cat(cols, dim=1), w)


@pytest.mark.parametrize("size", [1, 2])
def test_fused_qkv_and_gate_up_shards_reassemble_the_checkpoint(tiny_model, size):
    raw = raw_tensors(tiny_model)
    p = "model.layers.2."
    q, k, v = (raw[p + f"self_attn.{x}_proj.weight"] for x in "qkv")
    gate, up = raw[p + "mlp.gate_proj.weight"], raw[p + "mlp.up_proj.weight"]
    parts = {"q": [], "k": [], "v": [], "gate": [], "up": []}
    for r in range(size):
        fused = fused_qkv(q, k, v, r, size)
        qs, ks, vs = fused.split([q.shape[0] // size, k.shape[0] // size, v.shape[0] // size])
        parts["q"].append(qs), parts["k"].append(ks), parts["v"].append(vs)
        g, u = fused_gate_up(gate, up, r, size).split(gate.shape[0] // size)
        parts["gate"].append(g), parts["up"].append(u)
    for name, full in {"q": q, "k": k, "v": v, "gate": gate, "up": up}.items():
        assert torch.equal(torch.cat(parts[name]), full), name


def test_uneven_split_is_refused():
    with pytest.raises(ValueError, match="Cannot split 3 output channels over 2 ranks"):
        split_rows(torch.zeros(3, 4), 0, 2)
    with pytest.raises(ValueError, match="Cannot split 3 input channels over 2 ranks"):
        split_cols(torch.zeros(4, 3), 1, 2)


def test_tp2_postprocess_shards_reassemble_tp1(tiny_model):
    _, full = build(tiny_model)
    _, r0 = build(tiny_model, ranks=Ranks(tp_size=2, tp_rank=0))
    _, r1 = build(tiny_model, ranks=Ranks(tp_size=2, tp_rank=1))
    assert r0.tensors.keys() == r1.tensors.keys() == full.tensors.keys()
    for name, t in full.tensors.items():
        a, b = r0.tensors[name], r1.tensors[name]
        if name.endswith(("attn.o.weight", "mlp.down.weight")):
            assert torch.equal(torch.cat([a, b], dim=1), t), name
        elif name.endswith("attn.qkv.weight"):  # q | k | v blocks per rank
            sizes = [64, 32, 32]
            pieces = [torch.cat([x, y]) for x, y in zip(a.split(sizes), b.split(sizes))]
            assert torch.equal(torch.cat(pieces), t), name
        elif name.endswith("mlp.gate_up.weight"):
            pieces = [torch.cat([x, y]) for x, y in zip(a.split(192), b.split(192))]
            assert torch.equal(torch.cat(pieces), t), name
        else:  # embeddings, norms, LM head are replicated
            assert torch.equal(a, t) and torch.equal(b, t), name


def test_tp2_with_a_simulated_all_reduce_computes_tp1_logits(tiny_model):
    tp1, _ = build(tiny_model)
    expected = tp1(torch.tensor(PROMPT), 0, tp1.new_cache(len(PROMPT)))
    models = [build(tiny_model, ranks=Ranks(tp_size=2, tp_rank=r))[0] for r in range(2)]
    barrier, slots, results, errors = threading.Barrier(2, timeout=30), [None, None], [None, None], []

    def all_reduce_for(rank):
        def all_reduce(partial):
            slots[rank] = partial
            barrier.wait()
            total = slots[0] + slots[1]  # the same order on both ranks: identical sums
            barrier.wait()
            return total
        return all_reduce

    def run(rank):
        try:
            m = models[rank]
            m.set_all_reduce(all_reduce_for(rank))
            results[rank] = m(torch.tensor(PROMPT), 0, m.new_cache(len(PROMPT)))
        except Exception as e:  # noqa: BLE001 - surfaced by the assertion below
            errors.append(e)
            barrier.abort()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert torch.equal(results[0], results[1])
    assert_close(results[0], expected, 1e-5)


# -- quantization ----------------------------------------------------------------------------------

def test_int8_dequantizes_within_half_a_step_per_channel():
    w = torch.randn(64, 96) * 0.02
    stored = Int8WeightOnly().quantize(w, torch.float32)
    assert stored["qweight"].dtype == torch.int8 and stored["scale"].shape == (64,)
    err = (Int8WeightOnly().dequantize(stored, torch.float32) - w).abs()
    assert (err <= stored["scale"][:, None] / 2 + 1e-9).all()


def test_int8_model_output_is_within_tolerance_of_unquantized(tiny_model):
    """Stated tolerance: int8 logits within 2% of the logit range of the unquantized model, and the
    same greedy continuation for this prompt."""
    ref, _ = build(tiny_model)
    q, weights = build(tiny_model, quantization="int8")
    assert weights.tensors["layers.0.attn.qkv.qweight"].dtype == torch.int8
    assert weights.tensors["layers.0.attn.qkv.scale"].dtype == torch.float32
    a = ref(torch.tensor(PROMPT), 0, ref.new_cache(len(PROMPT)))
    b = q(torch.tensor(PROMPT), 0, q.new_cache(len(PROMPT)))
    assert not torch.equal(a, b)  # it really is quantized
    assert_close(b, a, 0.02)
    assert F.cosine_similarity(a, b, dim=0) > 0.999
    assert generate(q, PROMPT, 6) == generate(ref, PROMPT, 6)


def test_methods_run_here_and_the_upstream_names_refused():
    assert sorted(METHODS) == ["fp8", "int8", "none"]
    assert all(m().supports_pre_processed_weights for m in METHODS.values())
    assert CHOICES == ["awq", "compressed-tensors", "fp8", "gptq", "int8", "modelopt", "modelopt_fp4", "mxfp4", "none"]
    assert type(resolve(None, {})) is QuantMethod
    assert isinstance(resolve("fp8", {}), Fp8Online)
    with pytest.raises(QuantizationError, match=r"Unknown quantization method 'bitsandbytes'; supported: \['awq', "):
        resolve("bitsandbytes", {})


@pytest.mark.parametrize("method", ["gptq", "awq", "compressed-tensors"])
def test_repacking_methods_are_refused_for_the_cache_as_upstream_does_and_cannot_run_from_disk(method):
    for q in (resolve(None, {"quantization_config": {"quant_method": method}}), resolve(method, {})):
        assert isinstance(q, Refused) and q.supports_pre_processed_weights is False
        with pytest.raises(UnsupportedQuantForIPCError) as e:
            refuse_for_cache(q)
        assert str(e.value) == UnsupportedQuantForIPCError.TEMPLATE.format(
            method=method, reason=UnsupportedQuantForIPCError.REPACKED.format(method=method))
        with pytest.raises(QuantizationError, match=f"Quantization method '{method}' needs {method} kernels"):
            q.check_loadable()
    with pytest.raises(QuantizationError, match="formerly called 'gptq', was removed"):
        resolve("gptq", {}).check_loadable()


@pytest.mark.parametrize("qc, name", [({"quant_method": "modelopt", "quant_algo": "NVFP4"}, "NVIDIA ModelOpt NVFP4"),
                                      ({"quant_method": "mxfp4"}, "OCP MXFP4, as GPT-OSS ships")])
def test_nvfp4_and_mxfp4_are_refused_by_name_as_not_implemented(qc, name):
    q = resolve(None, {"quantization_config": qc})
    assert q.supports_pre_processed_weights  # upstream caches them: only not implemented here
    expected = QuantizationError.NOT_IMPLEMENTED.format(method=qc["quant_method"], what=name)
    for check in (q.check_loadable, lambda: refuse_for_cache(q)):
        with pytest.raises(QuantizationError) as e:
            check()
        assert str(e.value) == expected


def test_quantization_flag_must_name_the_checkpoints_method_as_in_vllm():
    with pytest.raises(QuantizationError) as e:
        resolve("int8", {"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}})
    assert str(e.value) == ("Quantization method specified in the model config (fp8) does not match the quantization "
                            "method specified in the `quantization` argument (int8).")


# -- binding and stages ----------------------------------------------------------------------------

def test_bind_weights_checks_names_shapes_and_dtypes(tiny_model):
    cfg = EngineConfig.build(str(tiny_model), "float32", None, "cpu")
    weights = load_processed(cfg, show_progress=False).bindable()
    meta = lambda: build_meta_model(cfg.shape, cfg.quant, cfg.dtype)
    model = bind_weights(meta(), weights)
    assert all(b.device.type == "cpu" for b in model.buffers())
    assert model.layers["1"].attn.qkv.weight is weights["layers.1.attn.qkv.weight"]  # bound, not copied
    with pytest.raises(BindError, match=r"missing \['norm.weight'\]"):
        bind_weights(meta(), {k: v for k, v in weights.items() if k != "norm.weight"})
    with pytest.raises(BindError, match=r"Tensor norm.weight is \(128,\) torch.bfloat16, the model expects \(128,\) torch.float32"):
        bind_weights(meta(), {**weights, "norm.weight": weights["norm.weight"].bfloat16()})


def test_pipeline_stages_split_layers_evenly():
    from wcache.core.llama_config import normalize

    cfg = normalize({"model_type": "llama", "vocab_size": 512, "hidden_size": 128, "intermediate_size": 384,
                     "num_hidden_layers": 4, "num_attention_heads": 4}, "config.json")
    stages = [ModelShape.from_config(cfg, pp_size=3, pp_rank=r) for r in range(3)]
    assert [list(s.layer_range) for s in stages] == [[0, 1], [2], [3]]
    assert [(s.first_stage, s.last_stage) for s in stages] == [(True, False), (False, False), (False, True)]
