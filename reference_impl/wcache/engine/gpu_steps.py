"""A GPU engine's forward passes as CUDA graphs: decode steps in tiles of slots, short prompts padded.

An eager forward pass of a llama-8b is some 1,300 small kernel launches, each paid in Python on the
engine thread, which shares the GIL with every HTTP thread: on an H200 a decode step took 20-23 ms
of host time for 6-9 ms of GPU work. A CUDA graph launches the whole pass at once.

A graph has fixed shapes, which also settles what batching may not change: the GPU's matrix
kernels are chosen by the number of rows, so a pass whose row count depended on the batch could
give a request different tokens in a batch than alone. Here no pass does:

* A decode step decodes a *tile*: ``rows`` consecutive KV cache slots (model/llama.py ``Tile``),
  idle ones included, over the first ``length`` positions of their slots, ``length`` a bucket (a
  power of two from 256, at most the slot). Tiles are ``min(TILE_ROWS, slots)`` wide and start at
  multiples of that width; the last one ends at the last slot (it may overlap the one before: a
  slot in both is decoded twice, identically, and its logits are taken once).
* A prompt runs alone, padded to a bucket of its length (16, 32, ... PROMPT_GRAPH_MAX; the padding
  comes after it, and a causal pass never lets a position see later ones); a longer prompt runs
  eagerly at its own length. Either way its pass is the one it gets alone.

One graph per (first slot, length) and per prompt bucket, captured the third time it is needed
(the first two run eagerly, the same kernels: warm-up), replayed from then on. All graphs share one
memory pool and copy their logits into buffers of their own, so holding many costs no more device
memory than the largest (``pool_bytes``, in the memory plan).
"""

from __future__ import annotations

import functools
import logging

import torch

from wcache.model.llama import Llama, Tile

log = logging.getLogger("wcache.engine")

TILE_ROWS = 64  # an H200 reads a llama-8b's weights once per step for up to 64 rows at almost no extra cost
FIRST_BUCKET = 256  # the shortest key length a decode graph attends over
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
        self.tokens, self.positions = self._inputs[: self.rows], self._inputs[self.rows : 2 * self.rows]
        self.prompt_ids, self.prompt_slot, self.prompt_last = (
            self._inputs[: self.prompt_max], self._inputs[self.prompt_max : self.prompt_max + 1],
            self._inputs[self.prompt_max + 1 : self.prompt_max + 2])
        self.logits = torch.empty(self.rows, vocab, dtype=torch.float32, device=device)
        self.prompt_logits = torch.empty(vocab, dtype=torch.float32, device=device)
        self._tiles: dict[tuple[int, int], Tile] = {}
        self._captured: dict[tuple, torch.cuda.CUDAGraph] = {}
        self._runs: dict[tuple, int] = {}
        self._pool = torch.cuda.graph_pool_handle() if graphs else None
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
        self.last_rows = len(by_tile) * self.rows
        for first, mine in by_tile.items():
            # Every running slot the tile covers gets its real token, its own or not. An idle row writes
            # its slot's last position, which no sequence reads before writing it itself: a sequence
            # whose prompt ran earlier in this step (engine.py: it decodes from the next one) keeps
            # its keys. (Position 0, at b43d6f0, overwrote that prompt's first key: a request's tokens
            # then depended on when it joined, and 1 of 64 llama-8b streams matched on an H100.)
            inside = [i for i, slot in enumerate(slots) if first <= slot < first + self.rows]
            toks, pos = [0] * self.rows, [self.slot_len - 1] * self.rows
            for i in inside:
                toks[slots[i] - first], pos[slots[i] - first] = tokens[i], starts[i]
            self._stage(toks + pos)
            length = bucket(max(starts[i] for i in inside) + 1, FIRST_BUCKET, self.slot_len)
            self._run(("decode", first, length), functools.partial(self._decode_tile, first, length), self.logits)
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

    def _decode_tile(self, first: int, length: int) -> torch.Tensor:
        tile = self._tiles.get((first, length))
        if tile is None:
            tile = self._tiles[(first, length)] = Tile(first, self.rows, length, self.logits.device)
        return self.model.decode_tile(self.tokens, self.positions, tile, self.cache)

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
    # Each decode graph keeps its tile's mask (a byte per key per row) and key positions: the
    # buckets of one tile add up to less than twice the slot.
    tiles = -(-num_slots // rows)
    masks = tiles * 2 * slot_len * (rows + 8)
    return max(peaks) + outputs + masks
