"""Quantization methods the engine can load, and whether the weight cache may serve them.

Each method declares how a projection is stored after post-processing and whether its
post-processed weights are self-contained (``supports_pre_processed_weights``): only then can the
daemon hand them to an engine. The ``gptq``-labelled method quantizes at load time with per-group
scales whose grouping the engine re-derives from its own config on load, so a cached copy is not
trusted; it is the real trigger of ``UnsupportedQuantForIPCError``.
"""

from __future__ import annotations

import hashlib
import json

import torch

from wcache.errors import UserError


class QuantMethod:
    name = "none"
    supports_pre_processed_weights = True

    def config(self) -> dict:
        return {"quant_method": self.name}

    def config_hash(self) -> str:
        return hashlib.sha256(json.dumps(self.config(), sort_keys=True).encode()).hexdigest()[:16]

    def stored_shapes(self, out_f: int, in_f: int, dtype: torch.dtype) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        return {"weight": ((out_f, in_f), dtype)}

    def quantize(self, w: torch.Tensor, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        return {"weight": w.to(dtype)}

    def dequantize(self, stored: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        return stored["weight"]


class Int8WeightOnly(QuantMethod):
    """Weight-only int8 with one float32 scale per output channel (symmetric, absmax / 127)."""

    name = "int8"

    def stored_shapes(self, out_f, in_f, dtype):
        return {"qweight": ((out_f, in_f), torch.int8), "scale": ((out_f,), torch.float32)}

    def quantize(self, w, dtype):
        w32 = w.float()
        scale = (w32.abs().amax(dim=1) / 127.0).clamp(min=1e-12)
        q = torch.round(w32 / scale[:, None]).clamp(-127, 127).to(torch.int8)
        return {"qweight": q, "scale": scale}

    def dequantize(self, stored, dtype):
        return (stored["qweight"].float() * stored["scale"][:, None]).to(dtype)


class GroupInt4(QuantMethod):
    """4-bit values (kept unpacked in int8) with a scale per group of 32 input channels."""

    name = "gptq"
    supports_pre_processed_weights = False
    group_size = 32

    def config(self):
        return {"quant_method": self.name, "bits": 4, "group_size": self.group_size}

    def stored_shapes(self, out_f, in_f, dtype):
        return {"qweight": ((out_f, in_f), torch.int8), "scale": ((out_f, in_f // self.group_size), torch.float32)}

    def quantize(self, w, dtype):
        out_f, in_f = w.shape
        g = w.float().view(out_f, in_f // self.group_size, self.group_size)
        scale = (g.abs().amax(dim=2) / 7.0).clamp(min=1e-12)
        q = torch.round(g / scale[..., None]).clamp(-8, 7).to(torch.int8).view(out_f, in_f)
        return {"qweight": q, "scale": scale}

    def dequantize(self, stored, dtype):
        q = stored["qweight"]
        out_f, in_f = q.shape
        g = q.float().view(out_f, in_f // self.group_size, self.group_size) * stored["scale"][..., None]
        return g.view(out_f, in_f).to(dtype)


METHODS: dict[str, type[QuantMethod]] = {"none": QuantMethod, "int8": Int8WeightOnly, "gptq": GroupInt4}


class QuantizationError(UserError):
    pass


def resolve(cli_choice: str | None, hf_config: dict) -> QuantMethod:
    """The CLI's ``--quantization`` wins; otherwise the checkpoint's ``quantization_config``."""
    name = cli_choice
    if name is None:
        name = (hf_config.get("quantization_config") or {}).get("quant_method", "none")
    if name not in METHODS:
        raise QuantizationError(f"Unknown quantization method {name!r}; supported: {sorted(METHODS)}")
    return METHODS[name]()
