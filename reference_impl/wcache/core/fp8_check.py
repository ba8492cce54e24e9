"""An FP8 checkpoint's stored types and block scales, checked before any weight reaches the device.

A block-wise FP8 checkpoint (model/quant.py's Fp8BlockCheckpoint) stores each quantized projection's
``weight`` as float8_e4m3fn and its ``weight_scale_inv`` as float32, every scale finite and
positive: a weight is its FP8 value times its block's scale. Anything else either breaks in torch
(e5m2 or bfloat16 weights next to a scale: "Promotion for Float8 Types is not supported") or, worse,
serves: NaN, inf, zero or negative scales answer with degenerate tokens, and integer scales are
read as numbers they are not. So ``check`` reads the shards' headers for the types and then the
scales, which are small, on the CPU for their values, and refuses the first wrong tensor by name
and file. `wcache serve`, the daemon's launcher and each rank's disk load call it; torch and
safetensors are imported only for an FP8 checkpoint (the launcher of any other imports no torch).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from wcache.core import shard_header
from wcache.errors import QuantizationError
from wcache.model.quant import Fp8BlockCheckpoint, QuantMethod

if TYPE_CHECKING:
    import torch

SCALE = "_scale_inv"
WEIGHT_DTYPE, SCALE_DTYPE = "F8_E4M3", "F32"


def check(model_dir: str, files: list[Path], quant: QuantMethod) -> None:
    """Refuse an FP8 checkpoint whose weights are not float8_e4m3fn, or whose block scales are not
    finite, positive float32 (QuantizationError naming the tensor and its file)."""
    if not isinstance(quant, Fp8BlockCheckpoint):
        return
    headers = {f: _tensors(f) for f in files}
    where = {name: f for f, tensors in headers.items() for name in tensors}
    for f, tensors in headers.items():
        for name, entry in tensors.items():
            if not name.endswith(SCALE):
                continue
            weight = name.removesuffix(SCALE)
            if entry["dtype"] != SCALE_DTYPE:
                _refuse(QuantizationError.FP8_SCALE_DTYPE, model_dir, name, f, entry["dtype"])
            if weight in where and headers[where[weight]][weight]["dtype"] != WEIGHT_DTYPE:
                _refuse(QuantizationError.FP8_WEIGHT_DTYPE, model_dir, weight, where[weight],
                        headers[where[weight]][weight]["dtype"])
        scales = [n for n in tensors if n.endswith(SCALE)]
        if scales:
            from safetensors import safe_open

            with safe_open(str(f), framework="pt", device="cpu") as opened:
                for name in scales:
                    _check_values(model_dir, name, f, opened.get_tensor(name))


def _tensors(path: Path) -> dict[str, dict]:
    _, header = shard_header.read_header(path)
    return {k: v for k, v in header.items() if k != "__metadata__"}


def _check_values(model_dir: str, name: str, path: Path, scale: torch.Tensor) -> None:
    import torch

    bad = ~(torch.isfinite(scale) & (scale > 0))
    if bool(bad.any()):
        index = tuple(int(i) for i in bad.nonzero()[0])
        _refuse(QuantizationError.FP8_SCALE_VALUE, model_dir, name, path, f"{scale[index].item()!r} at {list(index)}")


def _refuse(template: str, model_dir: str, tensor: str, path: Path, what: str) -> None:
    raise QuantizationError(template.format(model=model_dir, tensor=tensor, file=path.name, what=what))
