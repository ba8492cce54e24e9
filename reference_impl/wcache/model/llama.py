"""A compact Llama-style decoder: RMSNorm, RoPE, grouped-query attention, SwiGLU, KV cache, greedy.

The module is built on the meta device (no weight memory) and then *bound* to tensors that came
from disk or from the weight-cache daemon; `bind_weights` checks every tensor against the meta
placeholder's shape and dtype. Parameter names are the post-processed ones (fused qkv and gate_up,
optional int8 ``qweight``/``scale``), which is exactly what the daemon caches.

Tensor parallelism slices heads and MLP columns (see postprocess.py); the two row-parallel
projections (attention output, MLP down) call ``self.all_reduce``, which is the identity unless a
multi-rank engine installs a collective. Pipeline stages hold a contiguous range of layers, the
first stage the embedding and the last one the final norm and the LM head.
"""

from __future__ import annotations

import math
import mmap
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from wcache.model import rope
from wcache.model.quant import QuantMethod


@dataclass(frozen=True)
class ModelShape:
    """The model's dimensions plus which part of it this rank holds."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope: rope.Rope
    rms_norm_eps: float
    max_positions: int
    tie_embeddings: bool
    tp_size: int = 1
    pp_size: int = 1
    pp_rank: int = 0
    qk_norm: bool = False  # Qwen3: an RMSNorm over each query and key head, before RoPE
    qkv_bias: bool = False  # Qwen2: biases on the q, k and v projections

    @classmethod
    def from_config(cls, cfg: dict, tp_size: int = 1, pp_size: int = 1, pp_rank: int = 0) -> ModelShape:
        """From a config.json that wcache.core.llama_config.normalize resolved (every field present)."""
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=cfg["num_attention_heads"],
            num_kv_heads=cfg["num_key_value_heads"],
            head_dim=cfg["head_dim"],
            rope=rope.Rope.from_parameters(cfg["rope_parameters"]),
            rms_norm_eps=float(cfg["rms_norm_eps"]),
            max_positions=cfg["max_position_embeddings"],
            tie_embeddings=bool(cfg["tie_word_embeddings"]),
            tp_size=tp_size,
            pp_size=pp_size,
            pp_rank=pp_rank,
            qk_norm=bool(cfg.get("qk_norm")),
            qkv_bias=bool(cfg.get("qkv_bias")),
        )

    @property
    def layer_range(self) -> range:
        """Layers of this pipeline stage: an even split, earlier stages taking the remainder."""
        base, extra = divmod(self.num_layers, self.pp_size)
        start = self.pp_rank * base + min(self.pp_rank, extra)
        return range(start, start + base + (1 if self.pp_rank < extra else 0))

    @property
    def first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1


def _identity(t: torch.Tensor) -> torch.Tensor:
    return t


# CPU, bfloat16: oneDNN builds a matrix kernel the first time it meets a row count (x's first
# dimension), about 0.5 ms per weight shape; a pass of 16 prompts that came in a burst took 6.1 ms
# the first time and 2.8 ms after, so a fresh engine paid it in its busiest moment. Projections
# there pad their rows to one of few sizes (padded_rows), whose kernels RankRunner builds before the
# engine is ready (Llama.warm_rows), up to the row count where a projection's pass reaches
# ``PAD_MACS`` multiply-adds: past that, a pass is long enough that building a kernel adds little,
# and it runs its rows as they are. Rows are computed independently of each other in bfloat16 on CPU
# (engine.py, tests/unit/test_model.py): padding changes no row's result.
PAD_MACS = 1 << 27  # the tiny preset pads every pass (up to 512 rows); the small one up to 8 rows
ROW_STEP = 64  # row counts: powers of two up to this, then multiples of it


def padded_rows(n: int) -> int:
    return 1 << (n - 1).bit_length() if n <= ROW_STEP else -(-n // ROW_STEP) * ROW_STEP


def row_sizes(most: int) -> list[int]:
    """Every padded row count of at most ``most`` rows, smallest first."""
    top = padded_rows(most)
    small = {padded_rows(n) for n in range(1, min(top, ROW_STEP) + 1)}
    return sorted(small | set(range(2 * ROW_STEP, top + 1, ROW_STEP)))


def at_least_rows(x: torch.Tensor, project, rows: int) -> torch.Tensor:
    """``project(x)`` over at least ``rows`` rows (zero rows added, their results dropped): a GPU
    kernel whose result for a row depends on how few rows run with it (engine/worker/row_floors.py)."""
    n = x.shape[0]
    return project(x) if n >= rows else project(F.pad(x, (0, 0, 0, rows - n)))[:n]


def pad_rows(x: torch.Tensor, project, limit: int) -> torch.Tensor:
    """``project(x)``, with x's rows padded (zeros) to ``padded_rows`` if that is at most ``limit``
    (the padding's rows dropped from the result)."""
    n = x.shape[0]
    m = padded_rows(n)
    return project(x) if m == n or m > limit else project(F.pad(x, (0, 0, 0, m - n)))[:n]


class Linear(nn.Module):
    """A bias-free projection whose stored form is chosen by the quantization method."""

    def __init__(self, in_features: int, out_features: int, quant: QuantMethod, dtype: torch.dtype):
        super().__init__()
        for name, (shape, buf_dtype) in quant.stored_shapes(out_features, in_features, dtype).items():
            self.register_buffer(name, torch.empty(shape, dtype=buf_dtype))
        self.in_features, self.out_features = in_features, out_features
        self.quant = quant
        self.compute_dtype = dtype
        self.impl = "linear"  # the autotuner may choose another implementation
        self.pad_limit = 0  # rows padded up to this many (CPU, bfloat16; see padded_rows): Llama.warm_rows
        self.min_rows = 0  # GPU decoding: rows padded to at least this many (engine/worker/row_floors.py)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.min_rows:
            return at_least_rows(x, self._project, self.min_rows)
        return pad_rows(x, self._project, self.pad_limit) if self.pad_limit else self._project(x)

    def _project(self, x: torch.Tensor) -> torch.Tensor:
        y = self.quant.native_matmul(x, self._buffers)  # FP8 on Hopper's tensor cores, else None
        if y is not None:
            return y
        w = self.quant.dequantize(self._buffers, self.compute_dtype)
        if self.impl == "matmul_t":
            return torch.matmul(x, w.t())
        if callable(self.impl):  # a winner of the autotune pass (wcache.core.autotune): fn(x, w)
            return self.impl(x, w)
        return F.linear(x, w)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.register_buffer("weight", torch.empty(dim, dtype=dtype))
        self.eps = eps
        self.min_rows = 0  # GPU decoding: rows padded to at least this many (engine/worker/row_floors.py)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return at_least_rows(x, self._norm, self.min_rows) if self.min_rows else self._norm(x)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        # transformers' LlamaRMSNorm: normalize in float32, round to the input dtype, then scale by
        # the gain (the order matters in bfloat16).
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, s: ModelShape, quant: QuantMethod, dtype: torch.dtype):
        super().__init__()
        self.heads = s.num_heads // s.tp_size
        self.kv_heads = s.num_kv_heads // s.tp_size
        self.head_dim = s.head_dim
        self.qkv = Linear(s.hidden_size, (self.heads + 2 * self.kv_heads) * s.head_dim, quant, dtype)
        self.o = Linear(self.heads * s.head_dim, s.hidden_size, quant, dtype)
        self.all_reduce = _identity
        if s.qk_norm:  # Qwen3: one gain of head_dim, shared by every head (so not split over ranks)
            self.q_norm = RMSNorm(s.head_dim, s.rms_norm_eps, dtype)
            self.k_norm = RMSNorm(s.head_dim, s.rms_norm_eps, dtype)
        if s.qkv_bias:  # Qwen2: this rank's q, k and v biases, fused as the projection is (unquantized)
            self.register_buffer("qkv_bias", torch.empty((self.heads + 2 * self.kv_heads) * s.head_dim, dtype=dtype))

    def heads_of(self, qkv: torch.Tensor, rows: tuple[int, ...]):
        """q, k, v of a fused projection as heads, (*rows, heads, head_dim); Qwen3 normalizes each
        query and key head here, before RoPE, as Qwen3Attention does; Qwen2 adds its biases first."""
        if "qkv_bias" in self._buffers:
            qkv = qkv + self.qkv_bias
        q, k, v = qkv.split([self.heads * self.head_dim, self.kv_heads * self.head_dim,
                             self.kv_heads * self.head_dim], dim=-1)
        q, k = q.view(*rows, self.heads, self.head_dim), k.view(*rows, self.kv_heads, self.head_dim)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        return q, k, v.view(*rows, self.kv_heads, self.head_dim)

    def forward(self, x, cos, sin, cache_k, cache_v, batch: Batch) -> torch.Tensor:
        B, T = batch.size, batch.tokens  # x: (B*T, hidden), the batch's rows one after the other
        q, k, v = self.heads_of(self.qkv(x), (B, T))
        q = rope.apply(q, cos, sin)  # (B, T, heads, head_dim)
        k = rope.apply(k, cos, sin)  # (B, T, kv_heads, head_dim)
        # Each row writes its new keys and values at its own positions of its own cache slot.
        if batch.groups is not None:  # CPU, one new token per row: padded keys, one call per padded length
            cache_k[batch.slot_index, batch.positions] = k  # (B, 1) slots x (B, 1) positions: one write
            cache_v[batch.slot_index, batch.positions] = v
            out = torch.empty(B, self.heads, T, self.head_dim, dtype=q.dtype, device=x.device)
            for rows, slots, length in batch.groups:
                out[rows] = F.scaled_dot_product_attention(
                    q[rows].transpose(1, 2), cache_k[slots, :length].transpose(1, 2),
                    cache_v[slots, :length].transpose(1, 2), attn_mask=batch.mask[rows, :, :, :length],
                    enable_gqa=True)  # (G, heads, 1, head_dim)
        elif batch.rows is not None and batch.from_zero:  # CPU, prompts of one length from position 0
            # Their keys are their own new ones: no padding, so the rows attend in one call. The CPU
            # kernel splits its work by query and key length, not by batch, so a row's sums run as
            # they do alone (tests/integration/test_batching.py); a lone prompt takes this path too.
            cache_k[batch.slot_index, batch.positions] = k  # (B, 1) slots x (B, T) positions
            cache_v[batch.slot_index, batch.positions] = v
            out = F.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                enable_gqa=True)  # (B, heads, T, head_dim)
        elif batch.rows is not None:  # CPU, a verification of draft tokens, row by row: its own keys
            outs = []
            for b, (slot, start) in enumerate(batch.rows):
                end = start + T
                cache_k[slot, start:end] = k[b]
                cache_v[slot, start:end] = v[b]
                # Query i (absolute position start + i) sees keys 0..start + i; built here, not held
                # across layers, so the activation peak of a long prompt stays what it was.
                mask = torch.ones(T, end, dtype=torch.bool, device=x.device).tril(diagonal=start)
                outs.append(F.scaled_dot_product_attention(
                    q[b].transpose(0, 1), cache_k[slot, :end].transpose(0, 1), cache_v[slot, :end].transpose(0, 1),
                    attn_mask=mask, enable_gqa=True))  # (heads, T, head_dim)
            out = (outs[0] if B == 1 else torch.stack(outs)).view(B, self.heads, T, self.head_dim)
        elif batch.from_zero:  # GPU, prompts of one length from position 0: causal, no mask (flash)
            cache_k[batch.slot_index, batch.positions] = k
            cache_v[batch.slot_index, batch.positions] = v
            # cuDNN's kernel would build a plan for every new length. Flash runs 16-bit types only: a
            # float32 engine takes the memory-efficient kernel (or the math one where that cannot run).
            kernels = ([SDPBackend.FLASH_ATTENTION] if q.dtype in (torch.float16, torch.bfloat16)
                       else [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])
            with sdpa_kernel(kernels):
                out = F.scaled_dot_product_attention(
                    q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=True)
        else:  # GPU, a verification of draft tokens (or a decode step of a multi-rank engine)
            cache_k[batch.slot_index, batch.positions] = k
            cache_v[batch.slot_index, batch.positions] = v
            keys = cache_k[batch.slots, : batch.length]  # (B, L, kv_heads, head_dim), L = the longest row's end
            values = cache_v[batch.slots, : batch.length]
            # Query i of row b (absolute position start_b + i) sees keys 0..start_b + i of its own slot;
            # the keys past a shorter row's end are masked (exactly zero weight).
            out = F.scaled_dot_product_attention(
                q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2), attn_mask=batch.mask,
                enable_gqa=True)  # (B, heads, T, head_dim)
        return self.all_reduce(self.o(out.transpose(1, 2).reshape(B * T, self.heads * self.head_dim)))

    def decode(self, x, cos, sin, cache_k, cache_v, tile: Tile) -> torch.Tensor:
        """One new token for every slot of a tile (GPU decoding, see Tile): x (rows, hidden)."""
        n, group = tile.rows, self.heads // self.kv_heads
        q, k, v = self.heads_of(self.qkv(x), (n, 1))
        q, k = rope.apply(q, cos, sin), rope.apply(k, cos, sin)
        cache_k[tile.slot_index, tile.positions] = k[:, 0]
        cache_v[tile.slot_index, tile.positions] = v[:, 0]
        # The query heads that share a key head are stacked as that head's queries (head h reads key
        # head h // group): (rows, kv_heads, group, head_dim). Every operand then has kv_heads heads, so
        # the masked call runs a fused kernel instead of copying the keys once per query head.
        q = q.view(n, self.kv_heads, group, self.head_dim)
        if tile.attn_rows > n:  # the kernel keeps a row's result only from that many rows (row_floors.py)
            q = F.pad(q, (0, 0, 0, 0, 0, 0, 0, tile.attn_rows - n))
        out = decode_attention(q, cache_k[tile.attn_slots, : tile.length], cache_v[tile.attn_slots, : tile.length],
                               tile.mask)[:n]  # (rows, kv_heads, group, hd)
        return self.all_reduce(self.o(out.reshape(n, self.heads * self.head_dim)))


def decode_attention(q, keys, values, mask) -> torch.Tensor:
    """GPU decoding's attention: q (rows, kv_heads, group, head_dim) over keys and values (rows, L,
    kv_heads, head_dim), a view of the cache, the keys past each row's position masked. The
    memory-efficient kernel: a row's output measured the same whatever the other rows and the padded
    length (masked keys add exact zeros), on an H200 and an H100 (row_floors.py checks it per device)."""
    with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
        return F.scaled_dot_product_attention(q, keys.transpose(1, 2), values.transpose(1, 2), attn_mask=mask)


class MLP(nn.Module):
    def __init__(self, s: ModelShape, quant: QuantMethod, dtype: torch.dtype):
        super().__init__()
        self.inter = s.intermediate_size // s.tp_size
        self.gate_up = Linear(s.hidden_size, 2 * self.inter, quant, dtype)
        self.down = Linear(self.inter, s.hidden_size, quant, dtype)
        self.all_reduce = _identity

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).split(self.inter, dim=-1)
        return self.all_reduce(self.down(F.silu(gate) * up))


class Block(nn.Module):
    def __init__(self, s: ModelShape, quant: QuantMethod, dtype: torch.dtype):
        super().__init__()
        self.attn_norm = RMSNorm(s.hidden_size, s.rms_norm_eps, dtype)
        self.attn = Attention(s, quant, dtype)
        self.mlp_norm = RMSNorm(s.hidden_size, s.rms_norm_eps, dtype)
        self.mlp = MLP(s, quant, dtype)

    def forward(self, x, cos, sin, cache_k, cache_v, batch: Batch) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin, cache_k, cache_v, batch)
        return x + self.mlp(self.mlp_norm(x))

    def decode(self, x, cos, sin, cache_k, cache_v, tile: Tile) -> torch.Tensor:
        x = x + self.attn.decode(self.attn_norm(x), cos, sin, cache_k, cache_v, tile)
        return x + self.mlp(self.mlp_norm(x))


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed tensor. On CPU in fresh anonymous memory, which the kernel zeroes a page at a time
    when it is first written: a KV cache costs its pages only as sequences fill them, instead of a
    pass over all of it at allocation (128 MiB took 32 ms on a 2-core host, most of a promoted
    --respawn spare's start) and again when the process exits."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * dtype.itemsize
    if not nbytes:
        return torch.zeros(shape, dtype=dtype)
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=dtype).view(shape)  # the tensor keeps the map


class Llama(nn.Module):
    def __init__(self, s: ModelShape, quant: QuantMethod, dtype: torch.dtype):
        super().__init__()
        self.shape = s
        self.dtype = dtype
        self.pad_limit = 0  # the LM head's rows padded up to this many (warm_rows)
        self.head_min_rows = 0  # GPU decoding: the LM head's rows padded to at least this many (row_floors.py)
        if s.first_stage:
            self.embed = nn.Module()
            self.embed.register_buffer("weight", torch.empty(s.vocab_size, s.hidden_size, dtype=dtype))
        # Keys are the global layer numbers, so a pipeline stage's names match the full model's.
        self.layers = nn.ModuleDict({str(n): Block(s, quant, dtype) for n in s.layer_range})
        if s.last_stage:
            self.norm = RMSNorm(s.hidden_size, s.rms_norm_eps, dtype)
            self.lm_head = nn.Module()
            self.lm_head.register_buffer("weight", torch.empty(s.vocab_size, s.hidden_size, dtype=dtype))

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """The LM head's logits, in the compute dtype."""
        return pad_rows(x, self._head, self.pad_limit) if self.pad_limit else self._head(x)

    def _head(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.lm_head.weight)

    @torch.inference_mode()
    def warm_rows(self, most: int, head_most: int) -> int:
        """CPU, bfloat16 (see padded_rows): pad every projection's rows from now on, up to the
        largest padded row count of at most ``most`` rows at which its layer's projections stay
        within ``PAD_MACS`` multiply-adds (the LM head's, of at most ``head_most``: only a pass's
        final rows reach it), and run each projection shape once at every such count. Returns the
        projections' limit (0: none padded)."""
        linears = [m for m in self.modules() if isinstance(m, Linear)]
        first = {}  # one Linear per shape and implementation: the kernels do not depend on the weights
        for lin in linears:
            first.setdefault((lin.in_features, lin.out_features, repr(lin.impl)), lin)
        per_row = sum(lin.in_features * lin.out_features for lin in first.values())
        limit = max([m for m in row_sizes(most) if m * per_row <= PAD_MACS], default=0)
        head = self.shape.hidden_size * self.shape.vocab_size if self.shape.last_stage else 0
        head_limit = max([m for m in row_sizes(head_most) if m * head <= PAD_MACS], default=0) if head else 0
        for m in row_sizes(max(limit, head_limit, 1)):
            if m <= limit:
                for lin in first.values():
                    lin(torch.zeros(m, lin.in_features, dtype=self.dtype, device=self.device))
            if m <= head_limit:
                self.head(torch.zeros(m, self.shape.hidden_size, dtype=self.dtype, device=self.device))
        for lin in linears:
            lin.pad_limit = limit
        self.pad_limit = head_limit
        return limit

    def set_all_reduce(self, fn) -> None:
        for block in self.layers.values():
            block.attn.all_reduce = fn
            block.mlp.all_reduce = fn

    @property
    def device(self) -> torch.device:
        return next(iter(self.buffers())).device

    def new_cache(self, max_len: int, num_seqs: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer of this stage, keys and values of ``num_seqs`` slots of ``max_len`` positions:
        (num_seqs, max_len, kv_heads, head_dim) each. A sequence owns one slot while it runs."""
        s = self.shape
        shape = (num_seqs, max_len, s.num_kv_heads // s.tp_size, s.head_dim)
        return [(zeros(shape, self.dtype, self.device), zeros(shape, self.dtype, self.device)) for _ in s.layer_range]

    @torch.inference_mode()
    def forward(self, x: torch.Tensor, start, cache, all_positions: bool = False, slots=None,
                last: torch.Tensor | None = None) -> torch.Tensor:
        """One forward pass over a batch of sequences, each with the same number of new tokens.

        ``x``: token ids (first stage) or hidden states (later stages), either of one sequence,
        (T,) / (T, hidden), or of a batch, (B, T) / (B*T, hidden). ``start``: where the new tokens
        begin in each sequence (an int, or one int per row). ``slots``: each row's KV cache slot
        (default 0..B-1). Out: hidden states (B*T, hidden) on a stage before the last; on the last,
        the logits of each row's final position, (B, vocab) or (vocab,) for one sequence, or of
        every position with ``all_positions`` (speculative verification), (B, T, vocab) or (T, vocab).
        ``slots`` may be a device tensor and ``last`` one position (1,) whose logits to return instead
        of the final one's, for one prompt padded to a fixed length (a CUDA graph, engine/worker/gpu_steps.py).
        """
        s = self.shape
        one = isinstance(start, int)
        starts = [start] if one else list(start)
        B = len(starts)
        if s.first_stage:
            ids = x.view(B, -1)  # (B, T)
            T = ids.shape[1]
            x = F.embedding(ids.reshape(-1), self.embed.weight)  # (B*T, hidden)
        else:
            T = x.numel() // (B * s.hidden_size)
            x = x.view(B * T, s.hidden_size)
        slot_len = cache[0][0].shape[1] if cache else 0  # positions per cache slot
        if slots is None:
            slots = list(range(B))
        batch = Batch(starts, T, slots if isinstance(slots, torch.Tensor) else list(slots), x.device, slot_len)
        cos, sin = rope.cos_sin(batch.positions, s.rope, s.head_dim, self.dtype)  # (B, T, head_dim)
        for block, (ck, cv) in zip(self.layers.values(), cache):
            x = block(x, cos, sin, ck, cv, batch)
        if not s.last_stage:
            return x
        if all_positions:
            logits = self.head(self.norm(x)).float().view(B, T, -1)
        else:
            rows = x.view(B, T, -1)
            final = rows[:, -1] if last is None else rows.index_select(1, last)[:, 0]  # (B, hidden)
            logits = self.head(self.norm(final)).float()  # (B, vocab)
        return logits[0] if one else logits

    @torch.inference_mode()
    def decode_tile(self, tokens: torch.Tensor, positions: torch.Tensor, tile: Tile, cache) -> torch.Tensor:
        """One decode step of every slot of ``tile`` (a single-stage model on a GPU): ``tokens`` and
        ``positions`` (rows,) are each slot's last token and its position (for an idle slot, one that no
        sequence reads before writing it: see Tile).
        Out: logits (rows, vocab), float32. Only tensor operations on fixed shapes: a CUDA graph can
        hold it (engine/worker/gpu_steps.py)."""
        s = self.shape
        tile.place(positions)
        x = F.embedding(tokens, self.embed.weight)  # (rows, hidden)
        cos, sin = rope.cos_sin(positions[:, None], s.rope, s.head_dim, self.dtype)  # (rows, 1, head_dim)
        for block, (ck, cv) in zip(self.layers.values(), cache):
            x = block.decode(x, cos, sin, ck, cv, tile)
        return at_least_rows(self.norm(x), self._head, self.head_min_rows).float()


class Tile:
    """GPU decoding: ``rows`` consecutive KV cache slots from ``first``, one row each, attending over
    keys ``0..length-1`` of their own slot (a view of the cache, no copy), the keys past each row's
    position masked. Rows are slots, so an idle slot is a row too (it writes its slot's last position,
    which every sequence writes itself before reading it). ``rows`` is a bucket of the slots in use
    (engine/worker/gpu_steps.py); every kernel gives a row the same result at every bucket, or runs padded to
    the rows from which it does (``attn_rows`` for attention, which then reads that many slots:
    engine/worker/row_floors.py), so a row's result never depends on the others: the same tokens alone and
    in a batch (the kernels are chosen by shape)."""

    def __init__(self, first: int, rows: int, length: int, device, attn_rows: int = 0):
        self.first, self.rows, self.length = first, rows, length
        self.attn_rows = max(rows, attn_rows)
        self.attn_slots = slice(first, first + self.attn_rows)
        self.slot_index = torch.arange(first, first + rows, device=device)
        self.keys = torch.arange(length, device=device)
        self.positions = self.mask = None

    def place(self, positions: torch.Tensor) -> None:
        self.positions = positions
        if self.attn_rows > self.rows:  # padded rows see every key (their results are dropped)
            positions = F.pad(positions, (0, self.attn_rows - self.rows), value=self.length - 1)
        self.mask = (self.keys[None, :] <= positions[:, None])[:, None, None, :]  # (attn_rows, 1, 1, length)


PAD = 64  # CPU attention: keys padded to a multiple of this, whatever else is in the batch


class Batch:
    """Where a forward pass's rows are: positions, cache slots, and how attention reads them.

    Built once per forward pass and shared by every layer. On a GPU the rows attend in one call,
    over keys padded to the longest row and masked; slots that are one contiguous run are taken as
    a slice, a view of the cache (no copy). On CPU each row attends over exactly its own keys, one
    call per row: padding changes how the CPU kernels split their sums, so a padded row's output
    would differ in the last bits from the same sequence alone, and a batch must not change any
    request's tokens (the matrix products are batch-invariant in bfloat16, see engine.py)."""

    def __init__(self, starts: list[int], T: int, slots: list[int], device, slot_len: int = 0):
        self.size, self.tokens = len(starts), T
        if len(starts) == 1:
            self.positions = torch.arange(starts[0], starts[0] + T, device=device)[None]  # (1, T)
        else:
            self.positions = torch.tensor(starts, device=device)[:, None] + torch.arange(T, device=device)  # (B, T)
        self.rows = self.groups = self.mask = None
        self.from_zero = T > 1 and not any(starts)  # prompts: every row's keys are its own new ones
        if torch.device(device).type == "cpu":
            self.rows = list(zip(slots, starts))
            if self.from_zero:
                self.slot_index = torch.tensor(slots, device=device)[:, None]  # (B, 1)
            if T == 1:
                # A decoding row's keys are padded to a length that depends on that row alone (its end
                # rounded up to PAD, at most the slot), and the rows of one padded length attend in one call: the CPU
                # kernel's sums then run the same whatever else is in the batch.
                padded = [min(-(-(s + 1) // PAD) * PAD, slot_len) for s in starts]
                keys = torch.arange(max(padded), device=device)
                self.mask = (keys[None, None, :] <= self.positions[:, :, None])[:, None]  # (B, 1, 1, L)
                groups: dict[int, list[int]] = {}
                for b, length in enumerate(padded):
                    groups.setdefault(length, []).append(b)
                self.slot_index = torch.tensor(slots, device=device)[:, None]  # (B, 1)
                self.groups = [(torch.tensor(rows, device=device),
                                torch.tensor([slots[b] for b in rows], device=device), length)
                               for length, rows in groups.items()]
            return
        self.length = max(starts) + T  # keys the longest row sees
        if isinstance(slots, torch.Tensor):  # a prompt in a CUDA graph: its slot is an input
            self.slots, self.slot_index = slots, slots[:, None]
            return
        first = slots[0]
        contiguous = slots == list(range(first, first + len(slots)))
        self.slots = slice(first, first + len(slots)) if contiguous else torch.tensor(slots, device=device)
        self.slot_index = (torch.arange(first, first + len(slots), device=device) if contiguous
                           else self.slots)[:, None]  # (B, 1), broadcast against positions
        if not self.from_zero:  # (a causal prompt needs no mask)
            keys = torch.arange(self.length, device=device)
            self.mask = (keys[None, None, :] <= self.positions[:, :, None])[:, None]  # (B, 1, T, L)


def build_meta_model(s: ModelShape, quant: QuantMethod, dtype: torch.dtype) -> Llama:
    """The model's structure without weight memory: every buffer is a meta placeholder. A projection
    that the checkpoint keeps unquantized (quant.for_linear) gets its own method's placeholders."""
    with torch.device("meta"):
        model = Llama(s, quant, dtype)
        for name, module in list(model.named_modules()):
            if isinstance(module, Linear) and (own := quant.for_linear(hf_parts(name))) is not quant:
                model.set_submodule(name, Linear(module.in_features, module.out_features, own, dtype))
        return model


# The checkpoint (Hugging Face) modules behind each of this model's projections, fused ones in order.
HF_PARTS = {"attn.qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
            "attn.o": ("self_attn.o_proj",), "mlp.gate_up": ("mlp.gate_proj", "mlp.up_proj"),
            "mlp.down": ("mlp.down_proj",)}


def hf_parts(name: str) -> list[str]:
    """``layers.3.attn.qkv`` -> the checkpoint's q, k and v projection module names of layer 3."""
    _, layer, proj = name.split(".", 2)
    return [f"model.layers.{layer}.{p}" for p in HF_PARTS[proj]]


class BindError(Exception):
    pass


def bind_weights(model: Llama, tensors: dict[str, torch.Tensor]) -> Llama:
    """Point every placeholder buffer at a real tensor (no copy), checking shape and dtype."""
    placeholders = dict(model.named_buffers())
    missing = sorted(set(placeholders) - set(tensors))
    unexpected = sorted(set(tensors) - set(placeholders))
    if missing or unexpected:
        raise BindError(f"Weights do not fit the model: missing {missing[:5]}, unexpected {unexpected[:5]}")
    for name, t in tensors.items():
        ph = placeholders[name]
        if tuple(t.shape) != tuple(ph.shape) or t.dtype != ph.dtype:
            raise BindError(
                f"Tensor {name} is {tuple(t.shape)} {t.dtype}, the model expects {tuple(ph.shape)} {ph.dtype}"
            )
        owner_name, _, leaf = name.rpartition(".")
        model.get_submodule(owner_name)._buffers[leaf] = t
    return model


def generate(model: Llama, prompt_ids: list[int], max_tokens: int, eos_id: int | None = None, cache=None) -> list[int]:
    """Greedy decoding on a single-stage model (TP ranks run this in lockstep). ``cache``: a KV
    cache of at least len(prompt_ids) + max_tokens positions to reuse (the engine's, sized by its
    memory budget); by default one is allocated for this request."""
    if cache is None:
        cache = model.new_cache(len(prompt_ids) + max_tokens)
    tokens = torch.tensor(prompt_ids, dtype=torch.long, device=model.device)
    out: list[int] = []
    start = 0
    for _ in range(max_tokens):
        logits = model(tokens, start, cache)
        start += tokens.shape[0]
        nxt = int(torch.argmax(logits))
        out.append(nxt)
        if eos_id is not None and nxt == eos_id:
            break
        tokens = torch.tensor([nxt], dtype=torch.long, device=model.device)
    return out
