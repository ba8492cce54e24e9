"""Rotary position embeddings as transformers' Llama computes them: default, linear and llama3.

Operation for operation the same as transformers 5 (``modeling_rope_utils`` and
``LlamaRotaryEmbedding``): inverse frequencies in float32 from an int64 range, the type's scaling of
them, angles in float32, cos/sin cast to the activations' dtype, then the "rotate half" product in
that dtype. So a bfloat16 model rounds where transformers rounds. None of the three types scales
the attention (transformers' ``attention_factor`` is 1.0 for each).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Rope:
    rope_type: str = "default"
    theta: float = 10000.0
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_positions: int = 8192

    @classmethod
    def from_parameters(cls, p: dict) -> "Rope":
        """From a normalized 5.x ``rope_parameters`` dict (wcache.core.llama_config)."""
        return cls(p.get("rope_type", "default"), float(p.get("rope_theta", 10000.0)), float(p.get("factor", 1.0)),
                   float(p.get("low_freq_factor", 1.0)), float(p.get("high_freq_factor", 4.0)),
                   int(p.get("original_max_position_embeddings", 8192)))


def inv_freq(rope: Rope, head_dim: int, device=None) -> torch.Tensor:
    base = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim))
    if rope.rope_type == "linear":
        return base / rope.factor
    if rope.rope_type != "llama3":
        return base
    factor, low, high = rope.factor, rope.low_freq_factor, rope.high_freq_factor
    old = rope.original_max_positions
    low_wavelen, high_wavelen = old / low, old / high
    wavelen = 2 * math.pi / base
    scaled = torch.where(wavelen > low_wavelen, base / factor, base)  # long wavelengths: divided by factor
    smooth = (old / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled  # between the two: interpolated
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def cos_sin(positions: torch.Tensor, rope: Rope, head_dim: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    freqs = positions.float()[..., None] * inv_freq(rope, head_dim, positions.device)  # (..., T, head_dim / 2)
    emb = torch.cat([freqs, freqs], dim=-1)  # (..., T, head_dim)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: (..., T, heads, head_dim); cos, sin: (..., T, head_dim) in x's dtype; the "rotate half" convention.
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[..., None, :] + rotated * sin[..., None, :]
