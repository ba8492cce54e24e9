"""Turn Hugging Face checkpoint tensors into the engine's post-processed weights for one rank.

This is the expensive, cacheable part of loading: slice for the tensor-parallel rank, keep only the
pipeline stage's layers, fuse q/k/v and gate/up, quantize, cast. The daemon runs exactly this code
once; the engine's disk path runs it on every start.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from wcache.model.llama import ModelShape
from wcache.model.quant import QuantMethod


def split_rows(w: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """Column-parallel slice: this rank's block of output channels (dim 0)."""
    if w.shape[0] % size:
        raise ValueError(f"Cannot split {w.shape[0]} output channels over {size} ranks")
    n = w.shape[0] // size
    return w[rank * n : (rank + 1) * n]


def split_cols(w: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """Row-parallel slice: this rank's block of input channels (dim 1)."""
    if w.shape[1] % size:
        raise ValueError(f"Cannot split {w.shape[1]} input channels over {size} ranks")
    n = w.shape[1] // size
    return w[:, rank * n : (rank + 1) * n]


def fused_qkv(q, k, v, rank: int, size: int) -> torch.Tensor:
    # Heads are contiguous rows, so a row block of each projection is a block of whole heads.
    return torch.cat([split_rows(q, rank, size), split_rows(k, rank, size), split_rows(v, rank, size)])


def fused_gate_up(gate, up, rank: int, size: int) -> torch.Tensor:
    return torch.cat([split_rows(gate, rank, size), split_rows(up, rank, size)])


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


def needed_checkpoint_names(s: ModelShape) -> list[str]:
    """Checkpoint tensors this rank's stage reads (a pipeline stage skips the others' layers)."""
    names = []
    if s.first_stage or (s.last_stage and s.tie_embeddings):
        names.append("model.embed_tokens.weight")
    for n in s.layer_range:
        p = f"model.layers.{n}."
        names += [p + x for x in (
            "input_layernorm.weight", "self_attn.q_proj.weight", "self_attn.k_proj.weight",
            "self_attn.v_proj.weight", "self_attn.o_proj.weight", "post_attention_layernorm.weight",
            "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
        )]
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
    out: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}

    def linear(name: str, w: torch.Tensor) -> None:
        for leaf, t in quant.quantize(w, dtype).items():
            out[f"{name}.{leaf}"] = t.contiguous()

    if s.first_stage:
        out["embed.weight"] = raw.pop("model.embed_tokens.weight").to(dtype).contiguous()
    for n in s.layer_range:
        p = f"model.layers.{n}."
        q, k, v = (raw.pop(p + f"self_attn.{x}_proj.weight") for x in "qkv")
        out[f"layers.{n}.attn_norm.weight"] = raw.pop(p + "input_layernorm.weight").to(dtype).contiguous()
        linear(f"layers.{n}.attn.qkv", fused_qkv(q, k, v, tp_rank, tp))
        linear(f"layers.{n}.attn.o", split_cols(raw.pop(p + "self_attn.o_proj.weight"), tp_rank, tp))
        out[f"layers.{n}.mlp_norm.weight"] = raw.pop(p + "post_attention_layernorm.weight").to(dtype).contiguous()
        gate, up = raw.pop(p + "mlp.gate_proj.weight"), raw.pop(p + "mlp.up_proj.weight")
        linear(f"layers.{n}.mlp.gate_up", fused_gate_up(gate, up, tp_rank, tp))
        linear(f"layers.{n}.mlp.down", split_cols(raw.pop(p + "mlp.down_proj.weight"), tp_rank, tp))
    if s.last_stage:
        out["norm.weight"] = raw.pop("model.norm.weight").to(dtype).contiguous()
        if s.tie_embeddings and "embed.weight" in out:
            aliases["lm_head.weight"] = "embed.weight"
        elif s.tie_embeddings:
            out["lm_head.weight"] = raw.pop("model.embed_tokens.weight").to(dtype).contiguous()
        else:
            out["lm_head.weight"] = raw.pop("lm_head.weight").to(dtype).contiguous()
    attrs = {"quant_method": quant.name, "layers": [s.layer_range.start, s.layer_range.stop]}
    return ProcessedWeights(out, aliases, attrs)
