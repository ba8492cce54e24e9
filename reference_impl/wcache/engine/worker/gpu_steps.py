"""A GPU engine's forward passes as CUDA graphs: decode steps at a bucket of rows, short prompts padded.

An eager forward pass of a llama-8b is some 1,300 small kernel launches, each paid in Python on the
engine thread, which shares the GIL with every HTTP thread: on an H200 a decode step took 20-23 ms
of host time for 6-9 ms of GPU work. A CUDA graph launches the whole pass at once.

A graph has fixed shapes, which also settles what batching may not change: the GPU's kernels are
chosen by shape, so a pass whose shape depended on the batch could give a request different tokens
in a batch than alone. Here a pass's shape depends on which slots run, and every kernel is proven
(or padded) to compute a row the same way at each shape (row_floors.py):

* A decode step decodes, per *tile* of ``min(TILE_ROWS, slots)`` consecutive KV cache slots (tiles
  start at multiples of that width; the last one ends at the last slot and may overlap the one
  before: a slot in both is decoded twice, identically, and its logits are taken once), the tile's
  first ``rows`` slots up to its last running one, ``rows`` a bucket (1, 2, 4, ... the tile): a slot
  is a row (model/llama.py ``Tile``), idle ones inside the bucket included, each over the first
  ``length`` positions of its own slot, ``length`` a bucket too (a power of two from FIRST_BUCKET, at
  most the slot), the keys past its position masked. The scheduler hands out the lowest free slot
  and moves running sequences down into the holes finished ones leave (their keys copied:
  scheduler.compact), so the running slots stay packed at the bottom and a lone request decodes 1 row.
* A prompt runs alone, padded to a bucket of its length (16, 32, ... PROMPT_GRAPH_MAX; the padding
  comes after it, and a causal pass never lets a position see later ones); a longer prompt runs
  eagerly at its own length. Either way its pass is the one it gets alone.

What each shape costs, and why (one H100 80GB HBM3, torch 2.11.0+cu130, random llama-8b-shaped
bfloat16 weights, 2026-12-07: shared/reference/h100-2026-12-07, graph-probe.json and
decode-probe-f4ffa20.txt):

* The projections read every weight once per pass whatever its rows: 16 GB at 3.35 TB/s is 4.8 ms.
  Measured, the linears alone: 5.93 ms at 1 row, 6.41 ms at 64. Up to 64 rows a row costs almost
  nothing here; it is why a tile is 64 wide (TILE_ROWS) and why a lone row cannot get much below 6 ms.
* Attention reads each row's keys and values up to its length bucket: rows x length x 8 key heads x
  128 x 2 (keys, values) x 2 bytes per layer, whatever the row's own position. At 64 rows and 1,024
  keys that is 268 MB a layer, 8.6 GB a pass; the masked memory-efficient kernel took 0.146 ms a layer
  there (4.7 ms a pass; cuDNN 0.123, the math kernel 0.958). So the old fixed tile (64 rows, at least
  256 keys, f4ffa20) made a lone request pay 64 rows of attention and of projections; a bucket of 1
  row over 64 keys reads about 8 MB of keys and values a pass.
* A plain graph of the whole step (no tile, no mask, 512 keys) replayed in 6.06 ms at 1 row and
  7.91 ms at 64; the engine's 64-row tile at 1,024 keys in 12.8 ms, about its 12.28 ms step in the
  streaming record of f4ffa20. Past the projections and attention, the rest is the small kernels
  of norms, RoPE, the cache writes and the residual adds, a few microseconds each of device time
  whatever the rows; the streaming record's step_profile (step_clock.py) measures the step as the
  engine runs it, and bench/bare_step.py the plain step beside it, in the same run.
* Row invariance, measured there: row 0 of a 14336x4096 GEMM bit-identical at 1, 8, 64, 128, 256
  and 512 rows; the memory-efficient and cuDNN attention's row 0 identical at 1 row/512 keys and
  64 rows/1,024 keys (and masked keys equal to none). The engine checks every kernel of its own pass
  at start-up (row_floors.py: every projection shape and quantization, the LM head, RMSNorm, the
  masked attention and its key padding) and pads a kernel that sums a row differently below some row
  count to that count (a WARNING names it; the attention then reads that many slots); key buckets
  collapse to the whole slot if attention changes a row with padded keys. No GPU run has checked
  every llama-8b kernel yet: tests/gpu/test_row_buckets_gpu.py prints the floors it finds, and fails
  if a row's logits differ between buckets.

One graph per (first slot, rows, length) and per prompt bucket, captured the third time it is
needed (the first two run eagerly, the same kernels: warm-up), replayed from then on (a capture
took 12 ms for a plain step, 34 ms for the tile). All graphs share one memory pool and copy their
logits into one buffer, so holding many costs no more device memory than the largest
(``pool_bytes``, in the memory plan).
"""

from __future__ import annotations

import functools
import logging

import torch

from wcache.engine.worker import row_floors
from wcache.model.llama import Llama, Tile

log = logging.getLogger("wcache.engine")

TILE_ROWS = 64  # an H200 reads a llama-8b's weights once per step for up to 64 rows at almost no extra cost
FIRST_BUCKET = 64  # the shortest key length a decode graph attends over
PROMPT_GRAPH_MIN, PROMPT_GRAPH_MAX = 16, 512  # prompt buckets; longer prompts run eagerly
EAGER_RUNS = 2  # runs of a shape before its graph is captured


def bucket(need: int, smallest: int, largest: int) -> int:
    """The smallest power of two >= ``need`` from ``smallest``, at most ``largest``."""
    length = smallest
    while length < need:
        length *= 2
    return min(length, largest)


class GpuSteps:
    """The forward passes of one single-stage model on a GPU, over a KV cache of ``num_slots`` slots."""

    def __init__(self, model: Llama, cache, num_slots: int, graphs: bool = True):
        self.model, self.cache, self.num_slots = model, cache, num_slots
        self.rows = min(TILE_ROWS, num_slots)
        self.slot_len = cache[0][0].shape[1]
        self.graphs = graphs
        device = model.device
        vocab = model.shape.vocab_size
        # The graphs' inputs, filled through one pinned host buffer (one asynchronous copy), and outputs.
        self.prompt_max = min(PROMPT_GRAPH_MAX, self.slot_len)
        width = max(2 * self.rows, self.prompt_max + 2)
        self._host = torch.zeros(width, dtype=torch.long).pin_memory()
        self._inputs = torch.zeros(width, dtype=torch.long, device=device)
        self.prompt_ids, self.prompt_slot, self.prompt_last = (
            self._inputs[: self.prompt_max], self._inputs[self.prompt_max : self.prompt_max + 1],
            self._inputs[self.prompt_max + 1 : self.prompt_max + 2])
        self.logits = torch.empty(self.rows, vocab, dtype=torch.float32, device=device)
        self.prompt_logits = torch.empty(vocab, dtype=torch.float32, device=device)
        self._tiles: dict[tuple[int, int], Tile] = {}
        self._captured: dict[tuple, torch.cuda.CUDAGraph] = {}
        self._runs: dict[tuple, int] = {}
        self._pool = torch.cuda.graph_pool_handle() if graphs else None
        # Every kernel of a decode pass proven (or padded) to give a row the same result at every row
        # bucket, on this device, before the first step (row_floors.py).
        self.floors = row_floors.floors(model, self.rows, min(4 * FIRST_BUCKET, max(self.slot_len // 2, 1)))
        self.first_bucket = FIRST_BUCKET if self.floors.lengths_invariant else self.slot_len
        torch.cuda.empty_cache()  # the checks' scratch goes back to the device, for the graphs' pool
        self._staged = torch.cuda.Event()  # the last copy out of the host buffer
        self.last_rows = 0  # rows the last decode step computed (the step's record, step_clock.py)

    def first_slot(self, slot: int) -> int:
        """The first slot of the tile that decodes ``slot``."""
        return min(slot // self.rows * self.rows, self.num_slots - self.rows)

    def _stage(self, values: list[int]) -> None:
        """Copy ``values`` to the start of the graphs' inputs."""
        self._staged.synchronize()  # (a second tile of one step: its copy may still be queued)
        self._host[: len(values)] = torch.tensor(values)
        self._inputs[: len(values)].copy_(self._host[: len(values)], non_blocking=True)
        self._staged.record()

    # -- decode ---------------------------------------------------------------------------------
    def decode(self, slots: list[int], starts: list[int], tokens: list[int]) -> torch.Tensor:
        """Logits (len(slots), vocab) for one new token of each slot: ``tokens`` at ``starts``."""
        by_tile: dict[int, list[int]] = {}
        for i, slot in enumerate(slots):
            by_tile.setdefault(self.first_slot(slot), []).append(i)
        parts, order = [], []
        self.last_rows = 0
        for first, mine in by_tile.items():
            # Every running slot the tile covers gets its real token, its own or not. An idle row writes
            # its slot's last position, which no sequence reads before writing it itself: a sequence
            # whose prompt ran earlier in this step (engine.py: it decodes from the next one) keeps
            # its keys. (Position 0, at b43d6f0, overwrote that prompt's first key: a request's tokens
            # then depended on when it joined, and 1 of 64 llama-8b streams matched on an H100.)
            inside = [i for i, slot in enumerate(slots) if first <= slot < first + self.rows]
            # The tile's first rows, up to its last running slot, a bucket of them: the pass's work
            # grows with the slots in use (the scheduler gives out the lowest free slot first).
            n = bucket(max(slots[i] for i in inside) - first + 1, 1, self.rows)
            toks, pos = [0] * n, [self.slot_len - 1] * n
            for i in inside:
                toks[slots[i] - first], pos[slots[i] - first] = tokens[i], starts[i]
            self._stage(toks + pos)
            length = bucket(max(starts[i] for i in inside) + 1, self.first_bucket, self.slot_len)
            self._run(("decode", first, n, length), functools.partial(self._decode_tile, first, n, length),
                      self.logits[:n])
            self.last_rows += n
            rows = [slots[i] - first for i in mine]
            if rows == list(range(rows[0], rows[0] + len(rows))):  # the usual case: a slice, no index
                parts.append(self.logits[rows[0] : rows[0] + len(rows)].clone())
            else:
                parts.append(self.logits[torch.tensor(rows)].clone())
            order += mine
        out = parts[0] if len(parts) == 1 else torch.cat(parts)
        if order != list(range(len(slots))):
            out = out[torch.tensor(sorted(range(len(order)), key=order.__getitem__))]
        return out

    def _decode_tile(self, first: int, rows: int, length: int) -> torch.Tensor:
        tile = self._tiles.get((first, rows, length))
        if tile is None:
            tile = self._tiles[(first, rows, length)] = Tile(first, rows, length, self.logits.device,
                                                             attn_rows=self.floors.rows["attention"])
        # The staged inputs: ``rows`` tokens, then their positions (_stage).
        return self.model.decode_tile(self._inputs[:rows], self._inputs[rows : 2 * rows], tile, self.cache)

    # -- prompts --------------------------------------------------------------------------------
    def prompt(self, slot: int, tokens: list[int]) -> torch.Tensor | None:
        """Logits (1, vocab) after ``tokens``, a prompt from position 0 in ``slot``, or None when it
        is longer than the graphs' buckets (the caller runs it eagerly, alone)."""
        if len(tokens) > self.prompt_max:
            return None
        length = bucket(len(tokens), PROMPT_GRAPH_MIN, self.prompt_max)
        self._stage(tokens + [0] * (self.prompt_max - len(tokens)) + [slot, len(tokens) - 1])
        self._run(("prompt", length), lambda: self.model(self.prompt_ids[:length], 0, self.cache, slots=self.prompt_slot,
                                                         last=self.prompt_last), self.prompt_logits)
        return self.prompt_logits[None].clone()

    # -- graphs ---------------------------------------------------------------------------------
    def _run(self, key: tuple, forward, out: torch.Tensor) -> None:
        """``out`` = ``forward()``: eagerly the first EAGER_RUNS times, then by a graph of it."""
        graph = self._captured.get(key)
        if graph is not None:
            graph.replay()
            return
        runs = self._runs[key] = self._runs.get(key, 0) + 1
        if not self.graphs or runs <= EAGER_RUNS:
            out.copy_(forward())
            return
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            out.copy_(forward())
        self._captured[key] = graph
        graph.replay()  # a capture records the pass without running it
        log.debug("Captured the CUDA graph of %s", key)


@torch.inference_mode()
def pool_bytes(model: Llama, num_slots: int, slot_len: int) -> int:
    """Device memory the graphs hold: the larger peak of one eager decode tile (at the shortest key
    length: a longer one adds only its mask, one byte per key per row) and of the longest graphed
    prompt, each beyond its inputs, measured on a throw-away cache, plus the outputs and masks."""
    rows = min(TILE_ROWS, num_slots)
    prompt_len = min(PROMPT_GRAPH_MAX, slot_len)
    device = model.device
    ids = torch.zeros(max(rows, prompt_len), dtype=torch.long, device=device)
    passes = [(FIRST_BUCKET, rows, lambda cache: model.decode_tile(
                   ids[:rows], ids[:rows], Tile(0, rows, FIRST_BUCKET, device), cache)),
              (prompt_len, 1, lambda cache: model(ids[:prompt_len], 0, cache, slots=ids[:1], last=ids[:1]))]
    peaks = []
    for positions, slots, forward in passes:
        cache = model.new_cache(positions, slots)
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        forward(cache)
        torch.cuda.synchronize(device)
        peaks.append(torch.cuda.max_memory_allocated(device) - base)
        del cache
    # The throw-away caches (a tile's: 2 GiB for a llama-8b) go back to the device, not to the
    # allocator's cache, where the KV cache's tensors might not fit them and a spare would count them.
    torch.cuda.empty_cache()
    outputs = (rows + 1) * model.shape.vocab_size * 4
    # Each decode graph keeps its tile's mask (a byte per key per row) and key positions: the length
    # buckets of one row bucket add up to less than twice the slot, the row buckets to twice the tile.
    tiles = -(-num_slots // rows)
    masks = tiles * 2 * slot_len * (2 * rows + 8 * len(row_floors.buckets(rows)))
    return max(peaks) + outputs + masks
