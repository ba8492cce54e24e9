"""Turn Hugging Face checkpoint tensors into the engine's post-processed weights for one rank.

This is the expensive, cacheable part of loading: slice for the tensor-parallel rank, keep only the
pipeline stage's layers, fuse q/k/v and gate/up, quantize, cast. The quantization method decides how
a projection is read, sliced and fused: an FP8 checkpoint's weights are sliced together with their
block scales, along the block grid (a slice that would cut a block is refused, naming the sizes). The daemon runs exactly this code
once; the engine's disk path runs it on every start.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from wcache.model import fp8
from wcache.model.llama import HF_PARTS, ModelShape
from wcache.model.quant import QuantMethod


def split_rows(w: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """Column-parallel slice: this rank's block of output channels (dim 0)."""
    return QuantMethod().split_rows({"weight": w}, rank, size, "")["weight"]


def split_cols(w: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """Row-parallel slice: this rank's block of input channels (dim 1)."""
    return QuantMethod().split_cols({"weight": w}, rank, size, "")["weight"]


def fused_qkv(q, k, v, rank: int, size: int) -> torch.Tensor:
    return torch.cat([split_rows(q, rank, size), split_rows(k, rank, size), split_rows(v, rank, size)])


def fused_gate_up(gate, up, rank: int, size: int) -> torch.Tensor:
    return torch.cat([split_rows(gate, rank, size), split_rows(up, rank, size)])


# Heads are contiguous rows, so a row block of each of q, k and v is a block of whole heads; the
# attention output and MLP down projections are split along their input channels instead.
ROW_PARALLEL = ("attn.o", "mlp.down")
QK_NORMS = ("q_norm", "k_norm")  # Qwen3's per-head gains: the same names in the checkpoint and the model
QKV = ("q_proj", "k_proj", "v_proj")  # Qwen2's biased projections


@dataclass
class ProcessedWeights:
    """One rank's weights as the model binds them.

    ``aliases`` maps a name to another name whose tensor it shares (a tied LM head): the tensor is
    stored and sent once and bound under both names. ``attrs`` are small JSON values the engine
    needs besides tensors.
    """

    tensors: dict[str, torch.Tensor]
    aliases: dict[str, str] = field(default_factory=dict)
    attrs: dict = field(default_factory=dict)

    def bindable(self) -> dict[str, torch.Tensor]:
        out = dict(self.tensors)
        for alias, target in self.aliases.items():
            out[alias] = self.tensors[target]
        return out

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


def needed_checkpoint_names(s: ModelShape, quant: QuantMethod | None = None) -> list[str]:
    """Checkpoint tensors this rank's stage reads (a pipeline stage skips the others' layers), with
    the block scales of each FP8 projection (``quant``: the checkpoint's method)."""
    quant = quant or QuantMethod()
    names = []
    if s.first_stage or (s.last_stage and s.tie_embeddings):
        names.append("model.embed_tokens.weight")
    for n in s.layer_range:
        p = f"model.layers.{n}."
        names += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
        names += [p + f"self_attn.{norm}.weight" for norm in QK_NORMS] if s.qk_norm else []
        names += [p + f"self_attn.{proj}.bias" for proj in QKV] if s.qkv_bias else []
        for fused, parts in HF_PARTS.items():
            hf = [p + part for part in parts]
            leaves = quant.for_linear(hf).checkpoint_leaves()
            names += [f"{module}.{leaf}" for module in hf for leaf in leaves]
    if s.last_stage:
        names.append("model.norm.weight")
        if not s.tie_embeddings:
            names.append("lm_head.weight")
    return names


def postprocess(
    raw: dict[str, torch.Tensor], s: ModelShape, quant: QuantMethod, dtype: torch.dtype, tp_rank: int = 0
) -> ProcessedWeights:
    """``raw`` holds the checkpoint tensors by Hugging Face name; it is consumed (entries are
    deleted as they are processed) so transient memory stays near one layer's worth."""
    tp = s.tp_size
    if s.num_kv_heads % tp or s.num_heads % tp:
        raise ValueError(f"{s.num_heads} heads / {s.num_kv_heads} KV heads cannot be split over {tp} ranks")
    quant.check_loadable()
    out: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}

    def plain(name: str) -> torch.Tensor:
        """A tensor the model keeps unquantized; FP8 with block scales in the checkpoint (an lm_head
        not listed in modules_to_not_convert) is up-cast once, here."""
        t = raw.pop(name)
        scale = raw.pop(name + "_scale_inv", None)
        if scale is not None:
            block = (fp8.ceil_div(t.shape[0], scale.shape[0]), fp8.ceil_div(t.shape[1], scale.shape[1]))
            t = fp8.dequantize_blockwise(t, scale.float(), getattr(quant, "block", block), dtype)
        return t.to(dtype).contiguous()

    def linear(name: str, hf: list[str], row_parallel: bool) -> None:
        """One projection: each checkpoint part sliced for this rank, then fused and stored."""
        method = quant.for_linear(hf)
        parts = []
        for module in hf:
            part = {leaf: raw.pop(f"{module}.{leaf}") for leaf in method.checkpoint_leaves()
                    if f"{module}.{leaf}" in raw}
            if tp > 1:
                part = (method.split_cols if row_parallel else method.split_rows)(part, tp_rank, tp, module)
            parts.append(part)
        for leaf, t in method.process(parts, hf, name, dtype).items():
            out[f"{name}.{leaf}"] = t.contiguous()

    if s.first_stage:
        out["embed.weight"] = plain("model.embed_tokens.weight")
    for n in s.layer_range:
        p = f"model.layers.{n}."
        out[f"layers.{n}.attn_norm.weight"] = plain(p + "input_layernorm.weight")
        out[f"layers.{n}.mlp_norm.weight"] = plain(p + "post_attention_layernorm.weight")
        for norm in QK_NORMS if s.qk_norm else ():
            out[f"layers.{n}.attn.{norm}.weight"] = plain(p + f"self_attn.{norm}.weight")
        if s.qkv_bias:  # each of q, k and v sliced for this rank (heads are rows), then fused
            out[f"layers.{n}.attn.qkv_bias"] = fused_qkv(*(plain(p + f"self_attn.{proj}.bias") for proj in QKV),
                                                         tp_rank, tp)
        for fused, parts in HF_PARTS.items():
            linear(f"layers.{n}.{fused}", [p + part for part in parts], row_parallel=fused in ROW_PARALLEL)
    if s.last_stage:
        out["norm.weight"] = plain("model.norm.weight")
        if s.tie_embeddings and "embed.weight" in out:
            aliases["lm_head.weight"] = "embed.weight"
        elif s.tie_embeddings:
            out["lm_head.weight"] = plain("model.embed_tokens.weight")
        else:
            out["lm_head.weight"] = plain("lm_head.weight")
    attrs = {"quant_method": quant.name, "quantization_config": quant.config(),
             "layers": [s.layer_range.start, s.layer_range.stop]}
    return ProcessedWeights(out, aliases, attrs)
