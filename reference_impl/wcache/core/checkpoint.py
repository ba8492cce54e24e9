"""Deterministic Llama-architecture checkpoints in the Hugging Face layout.

`make_checkpoint` writes config.json, one or more ``*.safetensors`` shards and, when there is more
than one shard, ``model.safetensors.index.json``: what an engine finds in a downloaded model
directory, with the tokenizer files a downloaded model has (checkpoint_tokenizer.py: tokenizer.json,
tokenizer_config.json with a chat template, generation_config.json), so prompts are encoded, answers
decoded and ``POST /v1/chat/completions`` served as for a downloaded chat model. Weights are seeded
random numbers (no hub access); every tensor is drawn from its own
generator seeded by (seed, tensor name), so the bytes do not depend on shard layout or write order.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from wcache.core import checkpoint_tokenizer, llama_config
from wcache.core.checkpoint_files import DTYPE_NAMES
from wcache.model import fp8
from wcache.model.quant import Fp8BlockCheckpoint
from wcache.errors import QuantizationError


@dataclass(frozen=True)
class Preset:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    max_position_embeddings: int
    rope_theta: float
    max_shard_bytes: int
    # FP8 checkpoints (--quantization fp8): the weight block. 128x128 as the field ships; the narrow
    # presets use 32, their head_dim, so that a block never straddles a head: k and v have 64 rows
    # (fused q/k/v lines up on the block grid) and 32 per rank at tensor-parallel size 2.
    fp8_block: int = 128
    # "llama", "qwen3" (Qwen3ForCausalLM: q_norm and k_norm in every layer, head_dim given) or "qwen2"
    # (Qwen2ForCausalLM: q, k and v biases).
    model_type: str = "llama"
    head_dim: int | None = None  # None: hidden_size // num_attention_heads


PRESETS: dict[str, Preset] = {
    # A few MB; two shards so every test exercises the sharded layout and its index.
    "tiny": Preset(128, 384, 4, 4, 2, 512, 512, 10000.0, 1 << 20, fp8_block=32),
    # About 500 MB in bf16: big enough that disk and cache timings differ by orders of magnitude.
    "small": Preset(1024, 2816, 16, 16, 4, 32000, 2048, 10000.0, 256 << 20),
    # The shapes of Llama-3.1-8B: 291 tensors, about 16 GB in bf16.
    "llama-8b": Preset(4096, 14336, 32, 32, 8, 128256, 8192, 500000.0, 5 << 30),
    # 1,667 narrow layers: 10,005 post-processed tensors (about 650 MB), for the per-tensor cost.
    "tensors-10k": Preset(128, 384, 1667, 4, 2, 512, 512, 10000.0, 1 << 30, fp8_block=32),
    # Qwen3ForCausalLM, as tiny: a few MB, two shards, for CPU tests and the GPU tier's quick runs.
    "qwen3-tiny": Preset(128, 384, 4, 4, 2, 512, 512, 1000000.0, 1 << 20, fp8_block=32, model_type="qwen3",
                         head_dim=32),
    # Qwen2ForCausalLM, as tiny.
    "qwen2-tiny": Preset(128, 384, 4, 4, 2, 512, 512, 1000000.0, 1 << 20, fp8_block=32, model_type="qwen2"),
    # The shapes of Qwen3-8B (its FP8 sibling, Qwen3-8B-FP8, is block-wise 128x128): about 16 GB in bf16.
    "qwen3-8b": Preset(4096, 12288, 36, 32, 8, 151936, 40960, 1000000.0, 5 << 30, model_type="qwen3", head_dim=128),
}

DTYPES = {name: getattr(torch, name) for name in DTYPE_NAMES}  # the torch type of each compute dtype
QUANTIZATIONS = ("none", "fp8")  # what make-checkpoint writes: fp8 = transformers' block-wise layout
VOCAB_ROWS = ("model.embed_tokens.weight", "lm_head.weight")  # one row per token id
LINEAR_LEAVES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def fp8_quantization_config(block: int) -> dict:
    """config.json's quantization_config of an FP8 checkpoint, as transformers' FineGrainedFP8Config
    and the published FP8 models write it; the LM head stays unquantized, as transformers keeps it."""
    return {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [block, block],
            "modules_to_not_convert": ["lm_head"]}


def check_block_served(cfg: dict, block: int) -> None:
    """Refuse, before any tensor is made, a block size the loader would refuse for this shape (the
    checks loading makes, on meta tensors: quant.Fp8BlockCheckpoint.check_layout)."""
    try:
        Fp8BlockCheckpoint(cfg["quantization_config"]).check_layout(
            llama_config.normalize(dict(cfg), "config.json"), tp=1)
    except QuantizationError as e:
        raise QuantizationError(QuantizationError.BLOCK_NOT_SERVED.format(block=block, why=e)) from None


def is_quantized_linear(name: str) -> bool:
    return name.startswith("model.layers.") and name.endswith(".weight") and name.rsplit(".", 2)[-2] in LINEAR_LEAVES

def hf_config(preset: Preset, tie_embeddings: bool, dtype: str) -> dict:
    cfg = {
        "architectures": [llama_config.ARCHITECTURES[preset.model_type]],
        "model_type": preset.model_type,
        "hidden_size": preset.hidden_size,
        "intermediate_size": preset.intermediate_size,
        "num_hidden_layers": preset.num_hidden_layers,
        "num_attention_heads": preset.num_attention_heads,
        "num_key_value_heads": preset.num_key_value_heads,
        "vocab_size": preset.vocab_size,
        "max_position_embeddings": preset.max_position_embeddings,
        "rope_theta": preset.rope_theta,
        "rms_norm_eps": 1e-5,
        "hidden_act": "silu",
        "tie_word_embeddings": tie_embeddings,
        "torch_dtype": dtype,
        "bos_token_id": checkpoint_tokenizer.BOS_ID,
        "eos_token_id": checkpoint_tokenizer.EOS_ID,
    }
    if preset.head_dim is not None:
        cfg["head_dim"] = preset.head_dim
    if preset.model_type in ("qwen3", "qwen2"):  # as Qwen3Config and Qwen2Config write them
        cfg.update(use_sliding_window=False, sliding_window=None)
    if preset.model_type == "qwen3":
        cfg["attention_bias"] = False
    return cfg


def tensor_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    """Names and shapes in the Hugging Face Llama layout, in checkpoint order."""
    h, i, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    head_dim = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * head_dim, cfg["num_key_value_heads"] * head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h)}
    for n in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{n}."
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "self_attn.q_proj.weight"] = (q, h)
        shapes[p + "self_attn.k_proj.weight"] = (kv, h)
        shapes[p + "self_attn.v_proj.weight"] = (kv, h)
        shapes[p + "self_attn.o_proj.weight"] = (h, q)
        if cfg["model_type"] == "qwen3":
            shapes[p + "self_attn.q_norm.weight"] = shapes[p + "self_attn.k_norm.weight"] = (head_dim,)
        if cfg["model_type"] == "qwen2":
            shapes[p + "self_attn.q_proj.bias"] = (q,)
            shapes[p + "self_attn.k_proj.bias"] = shapes[p + "self_attn.v_proj.bias"] = (kv,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        shapes[p + "mlp.gate_proj.weight"] = (i, h)
        shapes[p + "mlp.up_proj.weight"] = (i, h)
        shapes[p + "mlp.down_proj.weight"] = (h, i)
    shapes["model.norm.weight"] = (h,)
    if not cfg["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (v, h)
    return shapes


def _generator(seed: int, name: str) -> torch.Generator:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little"))


def random_tensor(seed: int, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    gen = _generator(seed, name)
    if name.endswith("norm.weight"):
        # Norm gains near 1 (not exactly 1) so zeroing or editing one changes the model's output.
        t = 1.0 + 0.1 * torch.randn(shape, generator=gen)
    else:
        t = torch.randn(shape, generator=gen) * 0.02 * (4.0 if "embed" in name else 1.0)
    return t.to(dtype)


def make_checkpoint(
    out_dir: str | os.PathLike,
    preset: str = "tiny",
    tie_embeddings: bool = False,
    seed: int = 0,
    dtype: str = "bfloat16",
    max_shard_bytes: int | None = None,
    quantization: str = "none",
    weight_block_size: int | None = None,
) -> Path:
    """``quantization="fp8"``: every decoder projection's weights (the same values the unquantized
    checkpoint of this seed holds, in ``dtype``) quantized block-wise to float8_e4m3fn with a float32
    ``weight_scale_inv`` per block of ``weight_block_size`` (default: the preset's ``fp8_block``)."""
    if preset not in PRESETS:
        raise ValueError(f"Unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
    if dtype not in DTYPES:
        raise ValueError(f"Unknown dtype {dtype!r}; choose one of {sorted(DTYPES)}")
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"Unknown quantization {quantization!r}; choose one of {list(QUANTIZATIONS)}")
    p = PRESETS[preset]
    limit = max_shard_bytes or p.max_shard_bytes
    out = Path(out_dir)
    cfg = hf_config(p, tie_embeddings, dtype)
    shapes = tensor_shapes(cfg)
    torch_dtype = DTYPES[dtype]
    itemsize = torch.empty((), dtype=torch_dtype).element_size()
    block = None
    if quantization == "fp8":
        block = weight_block_size or p.fp8_block
        if block <= 0:
            raise ValueError(f"weight_block_size must be positive, got {block}")
        cfg["quantization_config"] = fp8_quantization_config(block)
        check_block_served(cfg, block)
        quantized = {}
        for name, shape in shapes.items():
            quantized[name] = shape
            if is_quantized_linear(name):
                quantized[name + "_scale_inv"] = (-(-shape[0] // block), -(-shape[1] // block))
        shapes = quantized

    def stored_bytes(name: str, shape: tuple[int, ...]) -> int:
        if block is None or not (is_quantized_linear(name) or name.endswith("_scale_inv")):
            return itemsize * _numel(shape)
        return (4 if name.endswith("_scale_inv") else 1) * _numel(shape)

    def tensors_of(names: list[str]) -> dict[str, torch.Tensor]:
        made = {}
        for n in names:
            if n.endswith("_scale_inv"):
                continue  # written with its weight
            t = random_tensor(seed, n, shapes[n], torch_dtype)
            if n in VOCAB_ROWS:
                # Rows past the tokenizer's ids are zeros, as a padded vocabulary's are never chosen in a
                # trained model: their logit 0 loses to the largest of the others, so a random model
                # answers with tokens that have text.
                t[token_ids:] = 0
            if block is not None and is_quantized_linear(n):
                made[n], made[n + "_scale_inv"] = fp8.quantize_blockwise(t, (block, block))
            else:
                made[n] = t
        return made

    out.mkdir(parents=True, exist_ok=True)  # after every refusal: a refused call leaves nothing behind
    token_ids = checkpoint_tokenizer.write(out, p.vocab_size, p.max_position_embeddings)
    # Plan shards first (by byte size, in checkpoint order) so file names carry the shard count; a
    # weight and its scale share a shard.
    shards: list[list[str]] = [[]]
    used = 0
    for name, shape in shapes.items():
        nbytes = stored_bytes(name, shape)
        if name.endswith("_scale_inv"):
            shards[-1].append(name)
            used += nbytes
            continue
        if shards[-1] and used + nbytes > limit:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += nbytes

    total = len(shards)
    weight_map: dict[str, str] = {}
    total_size = 0
    for idx, names in enumerate(shards, start=1):
        fname = "model.safetensors" if total == 1 else f"model-{idx:05d}-of-{total:05d}.safetensors"
        tensors = tensors_of(names)
        save_file(tensors, str(out / fname), metadata={"format": "pt"})
        for n, t in tensors.items():
            weight_map[n] = fname
            total_size += t.numel() * t.element_size()
        del tensors
    for stale in out.glob("*.safetensors"):
        if stale.name not in weight_map.values():
            stale.unlink()
    index = out / "model.safetensors.index.json"
    if total > 1:
        index.write_text(json.dumps({"metadata": {"total_size": total_size}, "weight_map": weight_map}, indent=2))
    elif index.exists():
        index.unlink()
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return out


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
