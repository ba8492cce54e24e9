"""FP8 (float8_e4m3fn) arithmetic: quantizing weights, up-casting them, and the Hopper matmuls.

Two stored layouts, both one byte per weight plus float32 scales:

* block-wise (checkpoints as transformers and DeepSeek write them): ``weight`` (out, in) in FP8 and
  ``weight_scale_inv`` (ceil(out / bn), ceil(in / bk)) in float32, the scale each block was divided
  by. Weight value = fp8 value x its block's scale.
* per-channel (``--quantization fp8`` on an unquantized checkpoint): ``weight`` (out, in) in FP8 and
  ``weight_scale`` (out,) in float32, one scale per output channel.

Execution. On a GPU of compute capability 9.0 or later (Hopper) with a bfloat16 compute dtype the
projection runs on ``torch._scaled_mm``: the activations are quantized per token (block-wise: per
token and 128 input channels, DeepSeek's 1x128 recipe; per-channel: one scale per token, the
row-wise recipe) and multiplied on the FP8 tensor cores. Elsewhere the FP8 weight stays FP8 in
memory and is up-cast for each matmul (``dequantize_*``), so the memory saving holds on every device
and CI runs the same stored layout. The recipe follows the H200 probe of 2026-12-04
(shared/probes/fp8_spare_probe.py): 128x128 weight blocks, float32 scales, M padded to a multiple
of 4; cuBLAS's block-wise kernel knows only 128-wide blocks, so other block sizes up-cast.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
HOPPER_BLOCK = (128, 128)  # the only block shape of cuBLAS's block-wise FP8 kernel


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


# -- quantizing --------------------------------------------------------------------------------
def quantize_blockwise(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 weight, weight_scale_inv) as transformers' Fp8Quantize computes them (scale = 448 /
    absmax of the block, stored as its inverse), generalised to a ragged last block row/column."""
    bn, bk = block
    out_f, in_f = w.shape
    rows, cols = ceil_div(out_f, bn), ceil_div(in_f, bk)
    padded = torch.zeros(rows * bn, cols * bk, dtype=torch.float32, device=w.device)
    padded[:out_f, :in_f] = w.float()
    tiles = padded.view(rows, bn, cols, bk)
    amax = tiles.abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, FP8_MAX / amax.clamp(min=torch.finfo(torch.float32).tiny), torch.ones_like(amax))
    q = (tiles * scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q.view(rows * bn, cols * bk)[:out_f, :in_f].contiguous(), (1.0 / scale).float()


def quantize_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 weight, weight_scale): one float32 scale per output channel, absmax / 448."""
    w32 = w.float()
    scale = (w32.abs().amax(dim=1) / FP8_MAX).clamp(min=1e-12)
    return (w32 / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


# -- up-casting (every device) -------------------------------------------------------------------
def expand_block_scales(scale_inv: torch.Tensor, shape: tuple[int, int], block: tuple[int, int]) -> torch.Tensor:
    """The (out, in) float32 scale of every weight element."""
    bn, bk = block
    out_f, in_f = shape
    return scale_inv.repeat_interleave(bn, dim=0)[:out_f].repeat_interleave(bk, dim=1)[:, :in_f]


def dequantize_blockwise(q: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
                         dtype: torch.dtype) -> torch.Tensor:
    # float32 product, then the compute dtype: what transformers' Fp8Dequantize does, so a float32
    # engine up-casts to exactly transformers' weights.
    bn, bk = block
    out_f, in_f = q.shape
    if out_f % bn == 0 and in_f % bk == 0:  # broadcast the scales: no (out, in) scale tensor
        tiles = q.float().view(out_f // bn, bn, in_f // bk, bk) * scale_inv[:, None, :, None]
        return tiles.view(out_f, in_f).to(dtype)
    return (q.float() * expand_block_scales(scale_inv, tuple(q.shape), block)).to(dtype)


def dequantize_per_channel(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (q.float() * scale[:, None]).to(dtype)


# -- FP8 tensor cores (Hopper) ---------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def fp8_tensor_cores(x: torch.Tensor) -> bool:
    """Whether ``x``'s device multiplies FP8 natively through ``torch._scaled_mm`` (compute
    capability 9.0 or later: Hopper, Blackwell)."""
    if not x.is_cuda or not hasattr(torch, "_scaled_mm"):
        return False
    return _capability(x.device.index if x.device.index is not None else torch.cuda.current_device()) >= (9, 0)


def _pad_rows(a: torch.Tensor, multiple: int = 4) -> torch.Tensor:
    """cuBLAS's FP8 kernels want M (tokens) padded to a multiple of 4 (the probe's recipe)."""
    extra = (-a.shape[0]) % multiple
    return F.pad(a, (0, 0, 0, extra)) if extra else a


# Quantizing the activations runs before every FP8 projection, four a layer: in a decode step of a
# llama-8b, 128 times over a few rows, where each kernel costs its launch, not its bytes. At f4ffa20
# it took 9 kernels (an up-cast copy, abs, amax, divide, clamp, divide, clamp, cast, transpose), some
# 1,150 a step beside the 128 matmuls, about what FP8's halved weight reads saved (64 streaming
# clients on an H100: 2,978 decode tokens/s against bf16's 3,155). Now 5, the same bits
# (tests/unit/test_fp8.py): the absolute maximum in one reduction read from bfloat16 and summed in
# float32 (a maximum is exact in any order), the scales computed where the scaled matmul wants them
# (outer-dim-major), and no clamp before the cast: x / (amax / 448) is at most 448 and one float32
# rounding, which the cast rounds to 448 as the clamp did.
def _absmax(x: torch.Tensor, dim: int, keepdim: bool = False) -> torch.Tensor:
    """max |x| along ``dim``, float32, in one reduction."""
    return torch.linalg.vector_norm(x, float("inf"), dim=dim, keepdim=keepdim, dtype=torch.float32)


def quantize_activation_1x128(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 x, scales (M, K/128) in column-major order): one scale per token and 128 channels,
    dynamic (from this call's values), as DeepSeek's recipe and vLLM's block FP8 do."""
    m, k = x.shape
    tiles = x.view(m, k // 128, 128)
    # reduced over a (K/128, M, 128) view: the scales come out (K/128, M), so their transpose is the
    # "outer-dim-major" (M, K/128) that cuBLAS's 1x128 scales need, with no copy
    scale_t = _absmax(tiles.transpose(0, 1), dim=2).div_(FP8_MAX).clamp_(min=1e-12)
    scale = scale_t.contiguous().t()  # (a no-op where the reduction already wrote it so)
    q = torch.div(tiles, scale[..., None]).to(FP8).view(m, k)  # bfloat16 / float32: float32, as before
    return q, scale


def blockwise_native_ok(x: torch.Tensor, weight: torch.Tensor, block: tuple[int, int]) -> bool:
    # cuBLAS reads each row of block scales as 16-byte aligned: with K/128 not a multiple of 4 (the
    # `small` preset's down projection, K = 2816: 22 scales of 4 bytes) the H200 returned a 30%
    # relative error, not a refusal. Such a projection up-casts; llama-8b's (32 and 112) run natively.
    out_f, in_f = weight.shape
    return (tuple(block) == HOPPER_BLOCK and x.dtype == torch.bfloat16 and in_f % 512 == 0
            and out_f % 128 == 0 and fp8_tensor_cores(x))


def scaled_mm_blockwise(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """x (M, K) bfloat16 @ weight (N, K) fp8 with 128x128 scales, on the FP8 tensor cores."""
    m = x.shape[0]
    xq, xs = quantize_activation_1x128(_pad_rows(x))
    # scale_b: (K/128, N/128), a transposed view of the stored (N/128, K/128); mat2 column-major.
    y = torch._scaled_mm(xq, weight.t(), xs, scale_inv.t(), out_dtype=x.dtype)
    return y[:m]


def quantize_activation_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 x, scales (M, 1)): one dynamic scale per token (as quantize_activation_1x128)."""
    scale = _absmax(x, dim=1, keepdim=True).div_(FP8_MAX).clamp_(min=1e-12)
    return torch.div(x, scale).to(FP8), scale


def rowwise_native_ok(x: torch.Tensor, weight: torch.Tensor) -> bool:
    out_f, in_f = weight.shape
    return x.dtype == torch.bfloat16 and in_f % 16 == 0 and out_f % 16 == 0 and fp8_tensor_cores(x)


def scaled_mm_rowwise(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x (M, K) bfloat16 @ weight (N, K) fp8 with one scale per output channel: the activations
    get one dynamic scale per token (the row-wise recipe; bfloat16 output)."""
    m = x.shape[0]
    xq, xs = quantize_activation_rows(_pad_rows(x))
    y = torch._scaled_mm(xq, weight.t(), xs, scale.view(1, -1), out_dtype=x.dtype)
    return y[:m]
