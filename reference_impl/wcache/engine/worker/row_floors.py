"""Which kernels of a GPU decode step give a row the same result whatever the rows beside it, on
this device: checked at start-up, and the kernels that do not are padded.

A GPU engine decodes a step at a *bucket* of rows (1, 2, 4, ... the tile, engine/worker/gpu_steps.py), so a
sequence decodes at 1 row alone and at 64 in a crowd. Its tokens stay those it gets alone only if
every kernel of the pass computes its row bit for bit the same at every bucket. The GPU's libraries
choose a kernel by shape (cuBLAS by the number of rows, with split-K or not; the memory-efficient
attention by rows and keys; a reduction's launch by how many rows it reduces), and different kernels
may sum in a different order. What the H100 probe found (shared/reference/h100-2026-12-07,
decode-probe-f4ffa20.txt; torch 2.11.0+cu130): row 0 of a 14336x4096 bfloat16 GEMM bit-identical at
1, 8, 64, 128, 256 and 512 rows, and the memory-efficient and cuDNN SDPA's row 0 identical at 1
row/512 keys and 64 rows/1024 keys, with masked keys past its length. The other shapes are not
covered by it, so ``floors`` checks every kernel the decode pass runs, once per engine, with random
rows: each projection shape (and quantization: FP8 quantizes each row's activations alone), the LM
head, RMSNorm and the masked attention. A kernel's *floor* is the fewest rows from which its rows
equal the whole tile's bit for bit, at every bucket up to the tile; a kernel with a floor above 1
runs padded to it (llama.at_least_rows; attention reads that many slots, Tile.attn_rows), so the
tile's invariance holds for it at the tile's cost and the other kernels keep their buckets.
Attention must also keep a row's result when its keys are padded to a longer bucket; where it does
not, every decode pass attends over the whole slot (``lengths_invariant`` False).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from wcache.model.llama import Linear, Llama, RMSNorm, decode_attention

log = logging.getLogger("wcache.engine")


@dataclass
class Floors:
    """Per kernel (a name), its floor in rows; whether attention keeps a row across key lengths."""

    rows: dict[str, int] = field(default_factory=dict)
    lengths_invariant: bool = True

    def padded(self) -> dict[str, int]:
        return {k: v for k, v in self.rows.items() if v > 1}


def buckets(tile: int) -> list[int]:
    """The row buckets of a tile: powers of two below it, then the tile."""
    out, b = [], 1
    while b < tile:
        out.append(b)
        b *= 2
    return out + [tile]


def floor_of(fn, x: torch.Tensor, sizes: list[int]) -> int:
    """The fewest rows in ``sizes`` from which ``fn`` of the first rows of ``x`` equals those rows of
    ``fn(x)`` (x has sizes[-1] rows), for that size and every larger one."""
    want = fn(x)
    floor = sizes[-1]
    for b in reversed(sizes[:-1]):
        if not torch.equal(fn(x[:b]), want[:b]):
            break
        floor = b
    return floor


def _random(shape, dtype, device, seed: int) -> torch.Tensor:
    g = torch.Generator(device=device).manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.float32, device=device).to(dtype)


@torch.inference_mode()
def attention_floor(model: Llama, tile: int, sizes: list[int], length: int) -> tuple[int, bool]:
    """(floor, lengths_invariant) of ``decode_attention`` for this model's heads: rows at their own
    positions over ``length`` keys against the same rows in the tile over twice as many."""
    s, device, dtype = model.shape, model.device, model.dtype
    kv, group = s.num_kv_heads // s.tp_size, s.num_heads // s.num_kv_heads
    q = _random((tile, kv, group, s.head_dim), dtype, device, 1)
    keys = _random((tile, 2 * length, kv, s.head_dim), dtype, device, 2)
    values = _random((tile, 2 * length, kv, s.head_dim), dtype, device, 3)
    g = torch.Generator(device=device).manual_seed(4)
    positions = torch.randint(0, length, (tile,), generator=g, device=device)

    def attend(rows: int, keys_seen: int) -> torch.Tensor:
        mask = (torch.arange(keys_seen, device=device)[None, :] <= positions[:rows, None])[:, None, None, :]
        return decode_attention(q[:rows], keys[:rows, :keys_seen], values[:rows, :keys_seen], mask)

    long = attend(tile, 2 * length)
    lengths_invariant = torch.equal(attend(tile, length), long)
    floor = tile
    for b in reversed(sizes[:-1]):
        if not torch.equal(attend(b, length), long[:b]):
            break
        floor = b
    return floor, lengths_invariant


@torch.inference_mode()
def floors(model: Llama, tile: int, length: int) -> Floors:
    """Check every kernel of ``model``'s decode pass at every bucket of ``tile`` rows (keys: a
    bucket of ``length`` against twice as many), and pad the ones that need it from now on."""
    sizes = buckets(tile)
    device, dtype = model.device, model.dtype
    out = Floors()
    linears: dict[tuple, list[Linear]] = {}
    for name, m in model.named_modules():
        if isinstance(m, Linear):  # the kernels depend on the shape and the stored form, not the values
            key = (m.in_features, m.out_features, type(m.quant).__name__, repr(m.impl))
            linears.setdefault(key, []).append(m)
    for (n_in, n_out, quant, _), mods in linears.items():
        name = f"linear {n_out}x{n_in} {quant}"
        out.rows[name] = floor_of(mods[0]._project, _random((tile, n_in), dtype, device, n_in + n_out), sizes)
        for m in mods:
            m.min_rows = out.rows[name]
    hidden = model.shape.hidden_size
    norms = [m for m in model.modules() if isinstance(m, RMSNorm)]
    out.rows["rms_norm"] = floor_of(norms[0]._norm, _random((tile, hidden), dtype, device, 5) * 3, sizes)
    for m in norms:
        m.min_rows = out.rows["rms_norm"]
    out.rows["lm_head"] = floor_of(model._head, _random((tile, hidden), dtype, device, 6), sizes)
    model.head_min_rows = out.rows["lm_head"]
    out.rows["attention"], out.lengths_invariant = attention_floor(model, tile, sizes, length)
    if out.padded() or not out.lengths_invariant:
        log.warning("Decode kernels that would give a row a different result in a smaller batch run padded "
                    "(rows): %s; attention keeps a row over padded keys: %s", out.padded(), out.lengths_invariant)
    else:
        log.info("Every decode kernel keeps a row's result at %s rows", sizes)
    return out
