"""Quantization methods the engine can load, and whether the weight cache may serve them.

Each method declares how a projection is read from the checkpoint, how it is stored after
post-processing and whether its post-processed weights are self-contained
(``supports_pre_processed_weights``, upstream's name): only then can the daemon hand them to an
engine. The methods, by the name ``--quantization`` and config.json's ``quant_method`` give them:

* ``none``: the checkpoint's weights in the compute dtype.
* ``int8``: weight-only int8 quantized at load, one scale per output channel.
* ``fp8``: on a checkpoint whose ``quantization_config`` says fp8 (transformers' and DeepSeek's
  block-wise layout), its FP8 weights and ``weight_scale_inv`` block scales as they are
  (``Fp8BlockCheckpoint``); on an unquantized checkpoint, FP8 quantized at load with one scale per
  output channel (``Fp8Online``, vLLM's online FP8; per channel rather than vLLM's per tensor, see
  its docstring). model/fp8.py holds the arithmetic and the Hopper matmuls.
* ``gptq``, ``awq``, ``compressed-tensors``: known by name and refused. Upstream refuses them for
  its weight cache (their kernels repack the weights after loading), and wcache has no kernels for
  them at all.
* ``modelopt`` (NVFP4) and ``mxfp4``: upstream serves them from its cache; not implemented here,
  and refused by name.

torch (and model/fp8.py) are imported by the methods that touch tensors, when first called:
`wcache preload`'s launcher resolves and refuses methods without torch, which only its ranks import.
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import TYPE_CHECKING

from wcache.errors import QuantizationError, UnsupportedQuantForIPCError

if TYPE_CHECKING:
    import torch


class QuantMethod:
    name = "none"
    supports_pre_processed_weights = True

    def config(self) -> dict:
        """What the cache key and the autotune key hash (``config_hash``): everything that changes
        the stored tensors."""
        return {"quant_method": self.name}

    def config_hash(self) -> str:
        return hashlib.sha256(json.dumps(self.config(), sort_keys=True).encode()).hexdigest()[:16]

    def check_loadable(self) -> None:
        """Raises QuantizationError where the engine cannot run the method at all (disk or cache)."""

    def check_layout(self, hf: dict, tp: int) -> None:
        """Raises QuantizationError where this tensor-parallel size cannot split the stored form
        (checked when the layout is planned, before any rank starts)."""

    # -- reading the checkpoint (core/postprocess.py) -----------------------------------------------
    def for_linear(self, hf_parts: list[str]) -> "QuantMethod":
        """The method of one projection, by its checkpoint module names (fused ones have several):
        itself, unless the checkpoint keeps that projection unquantized."""
        return self

    def checkpoint_leaves(self) -> tuple[str, ...]:
        """The tensors of one checkpoint projection, by leaf name."""
        return ("weight",)

    def split_rows(self, part: dict[str, torch.Tensor], rank: int, size: int, name: str) -> dict[str, torch.Tensor]:
        """Column-parallel slice of one projection: this rank's block of output channels."""
        w = part["weight"]
        if w.shape[0] % size:
            raise ValueError(f"Cannot split {w.shape[0]} output channels over {size} ranks")
        n = w.shape[0] // size
        return {"weight": w[rank * n : (rank + 1) * n]}

    def split_cols(self, part: dict[str, torch.Tensor], rank: int, size: int, name: str) -> dict[str, torch.Tensor]:
        """Row-parallel slice: this rank's block of input channels."""
        w = part["weight"]
        if w.shape[1] % size:
            raise ValueError(f"Cannot split {w.shape[1]} input channels over {size} ranks")
        n = w.shape[1] // size
        return {"weight": w[:, rank * n : (rank + 1) * n]}

    def process(self, parts: list[dict[str, torch.Tensor]], names: list[str], fused: str,
                dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """The stored tensors of one (maybe fused) projection from its parts, in fused row order."""
        import torch

        w = parts[0]["weight"] if len(parts) == 1 else torch.cat([p["weight"] for p in parts])
        return self.quantize(w, dtype)

    # -- the stored form and the matmul (model/llama.py's Linear) -----------------------------------
    def stored_shapes(self, out_f: int, in_f: int, dtype: torch.dtype) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        return {"weight": ((out_f, in_f), dtype)}

    def quantize(self, w: torch.Tensor, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        return {"weight": w.to(dtype)}

    def dequantize(self, stored: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        return stored["weight"]

    def native_matmul(self, x: torch.Tensor, stored: dict[str, torch.Tensor]):
        """``x @ W.T`` without up-casting the weight where the device multiplies the stored form
        natively, else None (the caller up-casts with ``dequantize``)."""
        return None


class Int8WeightOnly(QuantMethod):
    """Weight-only int8 with one float32 scale per output channel (symmetric, absmax / 127)."""

    name = "int8"

    def stored_shapes(self, out_f, in_f, dtype):
        import torch

        return {"qweight": ((out_f, in_f), torch.int8), "scale": ((out_f,), torch.float32)}

    def quantize(self, w, dtype):
        import torch

        w32 = w.float()
        scale = (w32.abs().amax(dim=1) / 127.0).clamp(min=1e-12)
        q = torch.round(w32 / scale[:, None]).clamp(-127, 127).to(torch.int8)
        return {"qweight": q, "scale": scale}

    def dequantize(self, stored, dtype):
        return (stored["qweight"].float() * stored["scale"][:, None]).to(dtype)


class Fp8Online(QuantMethod):
    """``--quantization fp8`` on an unquantized checkpoint: FP8 weights quantized at load with one
    float32 scale per output channel, activations quantized per token at run time.

    Per channel rather than vLLM's per tensor: one large row no longer coarsens every other row's
    steps; a fused q/k/v or gate/up keeps each row's own scale, so fusing needs no re-quantization
    to a common scale; and a tensor-parallel slice of rows carries its scales with it, whatever the
    split. On Hopper it runs on ``torch._scaled_mm``'s row-wise recipe."""

    name = "fp8"

    def config(self):
        return {"quant_method": "fp8", "format": "online", "weight_scale": "per-channel",
                "activation_scheme": "dynamic"}

    def stored_shapes(self, out_f, in_f, dtype):
        import torch

        from wcache.model import fp8

        return {"weight": ((out_f, in_f), fp8.FP8), "weight_scale": ((out_f,), torch.float32)}

    def quantize(self, w, dtype):
        from wcache.model import fp8

        q, scale = fp8.quantize_per_channel(w)
        return {"weight": q, "weight_scale": scale}

    def dequantize(self, stored, dtype):
        from wcache.model import fp8

        return fp8.dequantize_per_channel(stored["weight"], stored["weight_scale"], dtype)

    def native_matmul(self, x, stored):
        from wcache.model import fp8

        w = stored["weight"]
        if not fp8.rowwise_native_ok(x, w):
            return None
        flat = x.reshape(-1, x.shape[-1])
        return fp8.scaled_mm_rowwise(flat, w, stored["weight_scale"]).view(*x.shape[:-1], w.shape[0])


def _not_converted(name: str, patterns: list[str]) -> bool:
    """transformers' should_convert_module, negated: a pattern matches from the start up to a module
    boundary, as a regex with the same boundary, or as a suffix."""
    boundary = r"(?:(?<=\.)|(?=\.|$))"
    return any(re.match(rf"(?:{p}){boundary}", name) or name.endswith(p) for p in patterns)


class Fp8BlockCheckpoint(QuantMethod):
    """A checkpoint written as transformers' FineGrainedFP8 (DeepSeek-V3, Qwen3-*-FP8 and their
    peers): each projection's ``weight`` in float8_e4m3fn and its ``weight_scale_inv``, one float32
    scale per block of ``weight_block_size`` (out, in); activations quantized dynamically. The
    engine keeps both as they are (one byte per weight plus the scales); modules named in
    ``modules_to_not_convert`` are ordinary projections."""

    name = "fp8"

    def __init__(self, qc: dict, path: str = "config.json"):
        self.path = path
        scheme = qc.get("activation_scheme", "dynamic")
        if scheme != "dynamic":
            self._refuse("activation_scheme", scheme)
        block = qc.get("weight_block_size")
        if not (isinstance(block, (list, tuple)) and len(block) == 2
                and all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
            self._refuse("weight_block_size", block)
        if qc.get("scale_fmt", "float") != "float":
            self._refuse("scale_fmt", qc["scale_fmt"])
        self.block = (block[0], block[1])
        self.not_converted = list(qc.get("modules_to_not_convert") or [])

    def _refuse(self, field: str, value) -> None:
        raise QuantizationError(QuantizationError.FP8_FIELD.format(
            path=self.path, field=field, value=json.dumps(value), why=QuantizationError.FP8_WHY[field]))

    def config(self):
        return {"quant_method": "fp8", "format": "checkpoint", "weight_block_size": list(self.block),
                "activation_scheme": "dynamic", "modules_to_not_convert": self.not_converted}

    def for_linear(self, hf_parts):
        skipped = [_not_converted(p, self.not_converted) for p in hf_parts]
        if all(skipped):
            return QuantMethod()
        if any(skipped):
            prefix = hf_parts[0].rsplit(".", 1)[0]
            raise QuantizationError(QuantizationError.PARTLY_CONVERTED.format(prefix=prefix))
        return self

    def checkpoint_leaves(self):
        return ("weight", "weight_scale_inv")

    def check_part(self, part: dict[str, torch.Tensor], name: str) -> None:
        from wcache.model import fp8

        w, s = part["weight"], part.get("weight_scale_inv")
        if s is None:
            raise QuantizationError(QuantizationError.MISSING_SCALE.format(
                path=self.path, name=f"{name}.weight_scale_inv", tensor=name))
        expected = (fp8.ceil_div(w.shape[0], self.block[0]), fp8.ceil_div(w.shape[1], self.block[1]))
        if tuple(s.shape) != expected:
            raise QuantizationError(QuantizationError.SCALE_SHAPE.format(
                path=self.path, name=f"{name}.weight_scale_inv", shape=list(s.shape), weight=list(w.shape),
                block=list(self.block), expected=list(expected)))

    def check_layout(self, hf, tp):
        """The checks split_rows, split_cols and process make, on meta tensors of layer 0's shapes
        and in their order, so a layout that loading would refuse is refused before it starts."""
        import torch

        from wcache.model import fp8

        h, inter, hd = hf["hidden_size"], hf["intermediate_size"], hf["head_dim"]
        q, kv = hf["num_attention_heads"] * hd, hf["num_key_value_heads"] * hd
        shapes = {"self_attn.q_proj": (q, h), "self_attn.k_proj": (kv, h), "self_attn.v_proj": (kv, h),
                  "self_attn.o_proj": (h, q), "mlp.gate_proj": (inter, h), "mlp.up_proj": (inter, h),
                  "mlp.down_proj": (h, inter)}
        fused = {"attn.qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                 "attn.o": ("self_attn.o_proj",), "mlp.gate_up": ("mlp.gate_proj", "mlp.up_proj"),
                 "mlp.down": ("mlp.down_proj",)}
        for name, parts in fused.items():
            hf_names = [f"model.layers.0.{p}" for p in parts]
            if self.for_linear(hf_names) is not self:
                continue
            metas = []
            for module, part in zip(hf_names, parts):
                rows, cols = shapes[part]
                meta = {"weight": torch.empty(rows, cols, dtype=fp8.FP8, device="meta"),
                        "weight_scale_inv": torch.empty(fp8.ceil_div(rows, self.block[0]),
                                                        fp8.ceil_div(cols, self.block[1]), device="meta")}
                if tp > 1:
                    split = self.split_cols if name in ("attn.o", "mlp.down") else self.split_rows
                    meta = split(meta, 0, tp, module)
                metas.append(meta)
            self.process(metas, hf_names, f"layers.0.{name}", torch.bfloat16)

    def split_rows(self, part, rank, size, name):
        return self._split(part, rank, size, name, 0, QuantizationError.BLOCK_SPLIT_OUT)

    def split_cols(self, part, rank, size, name):
        return self._split(part, rank, size, name, 1, QuantizationError.BLOCK_SPLIT_IN)

    def _split(self, part, rank, size, name, dim: int, refusal: str):
        """Rank ``rank``'s 1/size of the weight and of its block scales along ``dim`` (0: output rows,
        1: input columns); a shard boundary inside a block is refused with the sizes."""
        self.check_part(part, name)
        w, s = part["weight"], part["weight_scale_inv"]
        n = w.shape[dim] // size
        if w.shape[dim] % size or n % self.block[dim]:
            raise QuantizationError(refusal.format(tensor=f"{name}.weight {list(w.shape)}", tp=size, size=n,
                                                   block=self.block[dim]))
        b = n // self.block[dim]
        return {"weight": w.narrow(dim, rank * n, n), "weight_scale_inv": s.narrow(dim, rank * b, b)}

    def process(self, parts, names, fused, dtype):
        import torch

        for part, name in zip(parts, names):
            self.check_part(part, name)
        # Rows of each part but the last must fill whole blocks, or the concatenated scale grid
        # would give some rows the next part's scales.
        for part, name in zip(parts[:-1], names[:-1]):
            if part["weight"].shape[0] % self.block[0]:
                raise QuantizationError(QuantizationError.BLOCK_FUSED.format(
                    tensor=name, fused=fused, size=part["weight"].shape[0], block=self.block[0]))
        if len(parts) == 1:
            return {"weight": parts[0]["weight"], "weight_scale_inv": parts[0]["weight_scale_inv"].float()}
        return {"weight": torch.cat([p["weight"] for p in parts]),
                "weight_scale_inv": torch.cat([p["weight_scale_inv"] for p in parts]).float()}

    def stored_shapes(self, out_f, in_f, dtype):
        import torch

        from wcache.model import fp8

        return {"weight": ((out_f, in_f), fp8.FP8),
                "weight_scale_inv": ((fp8.ceil_div(out_f, self.block[0]), fp8.ceil_div(in_f, self.block[1])),
                                     torch.float32)}

    def quantize(self, w, dtype):  # make-checkpoint's writer (core/checkpoint.py)
        from wcache.model import fp8

        q, s = fp8.quantize_blockwise(w, self.block)
        return {"weight": q, "weight_scale_inv": s}

    def dequantize(self, stored, dtype):
        from wcache.model import fp8

        return fp8.dequantize_blockwise(stored["weight"], stored["weight_scale_inv"], self.block, dtype)

    def native_matmul(self, x, stored):
        from wcache.model import fp8

        w = stored["weight"]
        if not fp8.blockwise_native_ok(x, w, self.block):
            return None
        flat = x.reshape(-1, x.shape[-1])
        return fp8.scaled_mm_blockwise(flat, w, stored["weight_scale_inv"]).view(*x.shape[:-1], w.shape[0])


class Refused(QuantMethod):
    """A method known by its upstream name that wcache does not run: ``cacheable`` says whether
    upstream serves it from its weight cache (then it is only not implemented here)."""

    def __init__(self, name: str, what: str, cacheable: bool):
        self.name, self.what = name, what
        self.supports_pre_processed_weights = cacheable

    def check_loadable(self):
        if self.supports_pre_processed_weights:
            raise QuantizationError(QuantizationError.NOT_IMPLEMENTED.format(method=self.name, what=self.what))
        extra = QuantizationError.OLD_GPTQ if self.name == "gptq" else ""
        raise QuantizationError(QuantizationError.NO_KERNELS.format(method=self.name) + extra)


# Upstream names wcache knows but does not run: (what it is, whether upstream caches it).
REFUSED = {
    "gptq": ("GPTQ int4/int8 with packed qweight, qzeros and g_idx", False),
    "awq": ("AWQ int4 with packed qweight and qzeros", False),
    "compressed-tensors": ("llm-compressor's compressed-tensors formats", False),
    "modelopt": ("NVIDIA ModelOpt, NVFP4 among others", True),
    "modelopt_fp4": ("NVIDIA ModelOpt NVFP4", True),
    "mxfp4": ("OCP MXFP4, as GPT-OSS ships", True),
}
METHODS: dict[str, type[QuantMethod]] = {"none": QuantMethod, "int8": Int8WeightOnly, "fp8": Fp8Online}
CHOICES = sorted([*METHODS, *REFUSED])  # what --quantization accepts (refused ones with their reason)


def resolve(cli_choice: str | None, hf_config: dict, path: str = "config.json") -> QuantMethod:
    """The checkpoint's ``quantization_config`` decides when it has one (``--quantization`` must
    then name the same method, as in vLLM); otherwise ``--quantization``, else none."""
    qc = hf_config.get("quantization_config") or {}
    in_config = qc.get("quant_method")
    if in_config is not None and cli_choice is not None and cli_choice != in_config \
            and not (in_config == "modelopt" and cli_choice == "modelopt_fp4"):
        raise QuantizationError(QuantizationError.MISMATCH.format(config=in_config, arg=cli_choice))
    name = in_config or cli_choice or "none"
    if in_config == "fp8":
        return Fp8BlockCheckpoint(qc, path)
    if name in REFUSED:
        what, cacheable = REFUSED[name]
        if name == "modelopt" and qc.get("quant_algo"):
            what = f"NVIDIA ModelOpt {qc['quant_algo']}"
        return Refused(name, what, cacheable)
    if name not in METHODS or (in_config is not None and name == "none"):
        raise QuantizationError(QuantizationError.UNKNOWN.format(name=name, supported=CHOICES))
    return METHODS[name]()


def refuse_for_cache(method: QuantMethod) -> None:
    """The weight cache's check (daemon and ipc_cache loader): upstream's refusal, then whether the
    engine can run the method at all."""
    if not method.supports_pre_processed_weights:
        raise UnsupportedQuantForIPCError(method.name)
    method.check_loadable()
