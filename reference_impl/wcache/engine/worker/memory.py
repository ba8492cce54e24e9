"""Memory accounting: how much of the device the engine may use, and what is left for the KV cache.

The budget is ``--gpu-memory-utilization`` x the device's capacity (on CPU, ``--cpu-memory-capacity``,
default the host's physical memory, so CI runs the very same arithmetic). It must hold

    own weights + externally held weights + activation peak + spare reserve + CUDA graphs + KV cache

* own weights: tensors this process allocated (a disk load, or a copy-mode clone);
* externally held weights: what the weight-cache daemon holds for this engine in zero_copy mode,
  as the daemon reports it (``get_memory``: exactly the cached tensor bytes, not everything the
  daemon process allocated). Counted once: after a copy or a disk fallback the engine maps nothing
  of the daemon's, so they are 0 and the weights count as its own;
* activation peak: measured by a real forward pass over ``max_model_len`` dummy tokens (CUDA: the
  allocator's peak; CPU: live tensor bytes followed op by op, see ``PeakTracker``);
* spare reserve (``wcache serve --respawn`` only, else 0): what the waiting hot spare holds on the
  device (engine/respawn/spare.py measures it: its context, its own weights if it has a copy, the
  warm-up's workspace), so the serving worker and the spare never over-commit the device;
* CUDA graphs (a GPU engine of one rank, engine/worker/gpu_steps.py, else 0): the memory pool that
  the CUDA graphs of its forward passes keep, measured by one eager pass of each kind;
* KV cache: the rest, in whole tokens of ``kv_bytes_per_token``. It is cut into slots of
  ``max_model_len`` tokens, one per running sequence: ``--max-num-seqs`` of them, or as many as
  the budget holds (``size_num_seqs``). Slots rather than pages of a block pool: a sequence that is
  admitted has room for its longest continuation, so the scheduler never has to preempt one, and the
  attention reads one contiguous tensor per row. The price is the tail of each slot that a short
  sequence leaves unused, which paged attention (vLLM) would lend to others.

When the external weights alone exceed the budget the engine refuses to start
(``ExternalWeightsExceedBudgetError``): no setting of the engine's own can fix that.

Not counted: memory that other processes hold on the device (another engine, a notebook, a daemon's
copy left behind by a fallback to disk) and the CUDA contexts. The budget is a share of the card's
total, not of what is free, so all of that must fit in the other ``1 - utilization``. On a GPU the
engine checks at start that the free memory holds what its plan will still allocate
(``check_free_memory``), and refuses in one line, as vLLM does, rather than fail in an out-of-memory.
"""

from __future__ import annotations

import json
import logging
import math
import os
import weakref
from contextlib import contextmanager
from dataclasses import asdict, dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from wcache.errors import (
    CacheUnusable,
    DeviceOutOfMemoryError,
    ExternalWeightsExceedBudgetError,
    FreeMemoryError,
    KVCacheBudgetError,
)

log = logging.getLogger("wcache.memory")

DEFAULT_UTILIZATION = 0.9
HELD_OUTSIDE = "Weights are held outside this process: {external} by the weight cache daemon; {split}"
BUDGET = "Memory budget: {split}"
PLAN_JSON = "Memory plan (bytes): {json}"
NO_MEMORY_REPORT = "The weight cache daemon did not report its memory ({error}); counting the {mapped} mapped"
KV_ALLOCATED = ("KV cache: {seqs} sequence(s) of {tokens} tokens allocated ({size}) for --max-model-len {length}; "
                "the budget holds {budget} tokens")
SEQS_LOWERED = ("Max number of sequences {want} lowered to {seqs}: the KV cache budget holds {tokens} tokens, "
                "{seqs} sequence(s) of --max-model-len {length}")

# Sizes are parsed where `wcache serve`'s flags are, in a module without torch (the front process).
from wcache.core.sizes import SIZE_HELP, parse_bytes  # noqa: F401 (the engine's own callers and tests')


def format_bytes(n: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def host_memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def device_capacity(device: torch.device, cpu_capacity: int | None = None) -> int:
    """Total memory of the device: the GPU's, or on CPU the flag's value, else physical memory."""
    if device.type == "cuda":
        if cpu_capacity is not None:
            log.warning("--cpu-memory-capacity applies to --device cpu only; using the GPU's capacity")
        return torch.cuda.mem_get_info(device)[1]
    return cpu_capacity if cpu_capacity is not None else host_memory_bytes()


def kv_bytes_per_token(shape, dtype: torch.dtype) -> int:
    """Key and value of one token in every layer of this rank's stage (its KV heads only)."""
    kv_heads = shape.num_kv_heads // shape.tp_size
    return 2 * len(shape.layer_range) * kv_heads * shape.head_dim * dtype.itemsize


@dataclass(frozen=True)
class MemoryPlan:
    device: str
    capacity: int
    utilization: float
    own_weights: int
    external_weights: int
    activation_peak: int
    kv_bytes_per_token: int
    spare_reserve: int = 0
    graph_pool: int = 0

    @property
    def budget(self) -> int:
        return int(self.capacity * self.utilization)

    @property
    def kv_cache_bytes(self) -> int:
        """What is left for the KV cache (negative when the rest does not even fit)."""
        return (self.budget - self.own_weights - self.external_weights - self.activation_peak - self.spare_reserve
                - self.graph_pool)

    @property
    def kv_tokens(self) -> int:
        if self.kv_bytes_per_token == 0:  # a pipeline stage without layers keeps no KV cache
            return 1 << 62
        return max(0, self.kv_cache_bytes) // self.kv_bytes_per_token

    def split(self) -> str:
        kv = max(0, self.kv_cache_bytes)
        return (f"budget {self.utilization:g} x {format_bytes(self.capacity)} = {format_bytes(self.budget)} = "
                f"own weights {format_bytes(self.own_weights)} + external weights "
                f"{format_bytes(self.external_weights)} + activation peak {format_bytes(self.activation_peak)} + "
                + (f"spare reserve {format_bytes(self.spare_reserve)} + " if self.spare_reserve else "")
                + (f"CUDA graphs {format_bytes(self.graph_pool)} + " if self.graph_pool else "")
                + f"KV cache {format_bytes(kv)} ({self.kv_tokens} tokens of {format_bytes(self.kv_bytes_per_token)})")

    def as_json(self) -> str:
        return json.dumps({**asdict(self), "budget": self.budget, "kv_cache_bytes": self.kv_cache_bytes,
                           "kv_tokens": self.kv_tokens}, sort_keys=True)


def external_weights(lease) -> int:
    """Bytes the daemon holds for this engine: 0 without a lease (disk, fallback or copy mode), else
    what the daemon reports over the lease (CacheLease.memory). When it cannot say, the reason is
    logged and the mapped size counts instead."""
    if lease is None or not lease.external_bytes:
        return 0
    try:
        return lease.memory()
    except CacheUnusable as e:
        log.warning(NO_MEMORY_REPORT.format(error=e, mapped=format_bytes(lease.external_bytes)))
        return lease.external_bytes


def check_external(capacity: int, utilization: float, external: int, device_type: str = "cuda") -> None:
    """Fail before profiling when the daemon's weights alone do not fit the budget."""
    budget = int(capacity * utilization)
    if external > budget:
        if external < capacity:
            needed = math.ceil(external / capacity * 100) / 100  # external / capacity, rounded up to 0.01
            fix = ExternalWeightsExceedBudgetError.FIX_RAISE.format(needed=f"{needed:.2f}")
        else:
            fix = ExternalWeightsExceedBudgetError.FIX_SMALL
        raise ExternalWeightsExceedBudgetError(
            external=format_bytes(external), memory=ExternalWeightsExceedBudgetError.MEMORY[device_type],
            utilization=f"{utilization:g}", capacity=format_bytes(capacity),
            budget=format_bytes(budget), fix=fix)


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f}"


def check_free_memory(free: int, total: int, utilization: float, counted: int, needed: int) -> None:
    """The start check on a GPU: the device's ``free`` memory must hold what this engine will still
    allocate, ``needed`` (its KV cache, CUDA graphs and activations, as the plan sized them). vLLM
    compares free memory with the whole budget, because its KV cache takes all the budget leaves;
    wcache's takes at most ``--max-num-seqs`` x ``--max-model-len`` tokens of it, so a small model's
    engine needs far less than its budget, and engines side by side on one GPU start (the GPU test
    tier runs so). Where the KV cache is bounded by the budget, the two checks are the same.
    On refusal the message names the utilization that fits: the budget at most ``free`` plus
    ``counted``, what of the budget is on the device already (this engine's own allocations, and in
    zero_copy mode the daemon's weights it maps)."""
    if free >= needed:
        return
    budget = int(total * utilization)
    fits = math.floor((free + counted) / total * 100) / 100  # the highest utilization that fits, rounded down
    fix = (FreeMemoryError.FIX_LOWER.format(fits=f"{fits:.2f}") if 0.01 <= fits < utilization
           else FreeMemoryError.FIX_NONE)
    raise FreeMemoryError(FreeMemoryError.TEMPLATE.format(
        free=_gib(free), total=_gib(total), needed=_gib(needed), utilization=f"{utilization:g}", budget=_gib(budget),
        fix=fix))


FREE_SETTLE_S = 3.0  # a refusal reads the free memory again for this long, then while it still grows
FREE_SETTLE_MAX_S = 30.0  # ... but no longer than this
_GROWING = 8 << 20  # bytes: the free memory grew between two reads, so a process is still giving it back


def check_device_free(device: torch.device, utilization: float, counted: int, needed: int) -> None:
    """``check_free_memory`` for this engine's device (a GPU; on CPU the capacity is a setting, and
    nothing is checked). Blocks this process's allocator keeps but no tensor uses count as free."""
    if device.type != "cuda":
        return
    cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    total = torch.cuda.mem_get_info(device)[1]
    settle_free(lambda: int(torch.cuda.mem_get_info(device)[0]) + cached,
                lambda free: check_free_memory(free, total, utilization, counted, needed))


def settle_free(read_free, check, clock=None, sleep=None) -> None:
    """``check(read_free())``, read again while a refusal may be memory still coming back. A killed
    process's device memory returns while the driver tears its context down, after the process is
    gone: a --respawn spare promoted after a crash may read before the dead worker's is back. So a
    refusal reads again for FREE_SETTLE_S, then on while the free memory still grows (at most
    FREE_SETTLE_MAX_S); memory that stays taken is refused after FREE_SETTLE_S."""
    import time

    clock, sleep = clock or time.monotonic, sleep or time.sleep
    start, before = clock(), None
    while True:
        free = read_free()
        try:
            return check(free)
        except FreeMemoryError:
            waited = clock() - start
            growing = before is not None and free - before >= _GROWING
            if waited >= FREE_SETTLE_MAX_S or (waited >= FREE_SETTLE_S and not growing):
                raise
            before = free
            sleep(0.5)


@contextmanager
def out_of_memory_named(device: torch.device, utilization: float, phase: str):
    """A CUDA out-of-memory inside becomes ``DeviceOutOfMemoryError`` (one line, exit 2) with the
    device's figures and the settings that get past it, instead of a traceback."""
    try:
        yield
    except torch.cuda.OutOfMemoryError:
        free, total = torch.cuda.mem_get_info(device)
        raise DeviceOutOfMemoryError(DeviceOutOfMemoryError.TEMPLATE.format(
            phase=phase, free=_gib(free), total=_gib(total), utilization=f"{utilization:g}",
            budget=_gib(int(total * utilization)))) from None


class PeakTracker(TorchDispatchMode):
    """The peak of live tensor bytes created while the mode is active (the CPU activation peak).

    Every tensor an op returns is counted by its storage (views share one); a storage leaves the
    count when the last tensor on it is garbage-collected. Storages that existed before (weights,
    the KV cache) are never counted, even when an op returns a view of them.
    """

    def __init__(self):
        super().__init__()
        self.refs: dict[int, list[int]] = {}  # storage data_ptr -> [tensor count, bytes]
        self.external: set[int] = set()
        self.live = 0
        self.peak = 0

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # Nothing here is compiled; keeping torch from wrapping __torch_dispatch__ in a dynamo guard
        # saves the seconds its first import of torch._dynamo costs every engine start.
        return False

    def _drop(self, key: int) -> None:
        entry = self.refs.get(key)
        if entry is None:
            return
        entry[0] -= 1
        if entry[0] == 0:
            del self.refs[key]
            self.live -= entry[1]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.utils._pytree import tree_flatten

        kwargs = kwargs or {}
        for t in tree_flatten((args, kwargs))[0]:
            if isinstance(t, torch.Tensor):
                key = t.untyped_storage().data_ptr()
                if key not in self.refs:
                    self.external.add(key)
        out = func(*args, **kwargs)
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            key = storage.data_ptr()
            if key == 0 or (key in self.external and key not in self.refs):
                continue
            entry = self.refs.get(key)
            if entry is None:
                entry = self.refs[key] = [0, storage.nbytes()]
                self.live += entry[1]
                self.peak = max(self.peak, self.live)
            entry[0] += 1
            weakref.finalize(t, self._drop, key)
        return out


ACTIVATION_FORMAT = "wcache-activation-peak"
ACTIVATION_REUSED = "Activation peak: {size} for {tokens} tokens, measured by an earlier start ({path})"
ACTIVATION_MEASURED = "Activation peak: {size} for {tokens} tokens, measured in {seconds:.2f} s; saved to {path}"


def activation_key(model, tokens: int) -> dict:
    """Everything that can change the measured peak, as the autotune cache keys its results: the
    model's shapes and dtype on this rank, each projection's implementation (the autotune winners)
    and row padding, the device, torch and wcache versions, the allocator settings and the token count."""
    from wcache import __version__
    from wcache.model.llama import Linear

    device = model.device
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    return {"format": ACTIVATION_FORMAT, "wcache_version": __version__, "torch_version": torch.__version__,
            "shape": repr(model.shape), "dtype": str(model.dtype), "tokens": tokens,
            "quantization": sorted({type(m.quant).__name__ for m in linears}),
            "impls": sorted({_impl_name(m.impl) for m in linears}),
            "pad_limit": max((m.pad_limit for m in linears), default=0),  # padded rows (llama.padded_rows)
            "device_kind": device.type,
            "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "cuda": torch.version.cuda if device.type == "cuda" else None,
            "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")}


def _impl_name(impl) -> str:
    """A projection's implementation by its autotune name: a function's repr holds its address."""
    from wcache.core.autotune import ALL

    if isinstance(impl, str):
        return impl
    return next((name for name, fn in ALL.items() if fn is impl), repr(impl))


def _activation_path(key: dict):
    import hashlib

    from wcache.core.fingerprint import cache_root

    digest = hashlib.sha256(json.dumps(key, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:32]
    return cache_root() / "activation-peak" / f"{digest}.json"


def measure_activation_peak(model, tokens: int) -> int:
    """The activation peak of ``model`` over ``tokens``, remembered on disk like the autotune results:
    a restarted engine with the same shapes, dtype, kernels and device reads it instead of running
    the profiling forward again. A record that cannot be read or written costs only a measurement."""
    import tempfile
    import time

    key = activation_key(model, tokens)
    path = _activation_path(key)
    try:
        doc = json.loads(path.read_text())
        peak = doc["bytes"]
        if doc.get("key") == key and isinstance(peak, int) and not isinstance(peak, bool) and peak >= 0:
            log.info(ACTIVATION_REUSED.format(size=format_bytes(peak), tokens=tokens, path=path))
            return peak
    except (OSError, ValueError, KeyError, TypeError):
        pass
    t0 = time.perf_counter()
    peak = _measure_activation_peak(model, tokens)
    try:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
        with os.fdopen(fd, "w") as f:
            json.dump({"key": key, "bytes": peak}, f)
        os.replace(tmp, path)  # readers see the old record or the new one, never half of one
        log.info(ACTIVATION_MEASURED.format(size=format_bytes(peak), tokens=tokens, path=path,
                                            seconds=time.perf_counter() - t0))
    except OSError as e:
        log.warning("Could not save the activation peak to %s (%s); the next start measures it again", path, e)
    return peak


def _measure_activation_peak(model, tokens: int) -> int:
    """Bytes of activations at the peak of one forward pass over ``tokens`` dummy tokens (a prefill of
    the longest prompt the engine accepts). The KV cache it needs is allocated first and not counted."""
    s = model.shape
    device = model.device
    cache = model.new_cache(tokens)
    if s.first_stage:
        x = torch.randint(0, s.vocab_size, (tokens,), device=device)
    else:
        x = torch.randn(tokens, s.hidden_size, device=device).to(model.dtype)
    # Collectives of a tensor-parallel engine would need every rank in step; the activations are
    # the same without them.
    saved = [(b.attn.all_reduce, b.mlp.all_reduce) for b in model.layers.values()]
    model.set_all_reduce(lambda t: t)
    try:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device)
            model(x, 0, cache)
            torch.cuda.synchronize(device)
            peak = torch.cuda.max_memory_allocated(device) - base
        else:
            with PeakTracker() as tracker:
                model(x, 0, cache)
            peak = tracker.peak
    finally:
        for b, (a, m) in zip(model.layers.values(), saved):
            b.attn.all_reduce, b.mlp.all_reduce = a, m
        del cache, x
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return int(peak)


def size_max_model_len(plan: MemoryPlan, requested: int | None, default: int, max_positions: int,
                       tokens: int | None = None) -> int:
    """The longest sequence the engine serves: the requested (or default) length, at most what the
    KV cache budget holds. An explicit --max-model-len that does not fit is an error. ``tokens``:
    what the budget holds when not ``plan.kv_tokens`` (the least of every rank's, or less a
    speculative draft's look-ahead)."""
    tokens = plan.kv_tokens if tokens is None else tokens
    want = min(requested or default, max_positions)
    if tokens < 1:
        raise KVCacheBudgetError(KVCacheBudgetError.NO_ROOM.format(split=plan.split(), fix=kv_fix(plan, want, 0)))
    if requested is not None and tokens < want:
        raise KVCacheBudgetError(KVCacheBudgetError.TOO_LONG.format(length=want, tokens=tokens, split=plan.split(),
                                                                    fix=kv_fix(plan, want, tokens)))
    if tokens < want:
        log.warning("Max model length %d lowered to %d: the KV cache budget holds no more tokens", want, tokens)
    return min(want, tokens)


def kv_fix(plan: MemoryPlan, length: int, tokens: int) -> str:
    """The way out of a KV cache that cannot hold ``length`` tokens (``tokens`` fit now): a higher
    utilization where one below 1 holds everything plus one sequence; else a shorter --max-model-len,
    since the activation peak is measured over it; else the weights alone are too big for the device."""
    E = KVCacheBudgetError
    fixed = plan.budget - plan.kv_cache_bytes  # everything but the KV cache
    need = fixed + length * plan.kv_bytes_per_token
    needed = math.ceil(need / plan.capacity * 100) / 100
    if needed < 1:
        fix = E.FIX_RAISE["cuda" if plan.device.startswith("cuda") else "cpu"].format(needed=f"{needed:.2f}")
        if tokens:
            return fix + E.OR_SHORTER.format(tokens=tokens)
        return fix + E.OR_SHORTER_PEAK.format(peak=format_bytes(plan.activation_peak), length=length)
    weights = fixed - plan.activation_peak
    if weights < plan.capacity:
        return E.FIX_PEAK.format(length=length, peak=format_bytes(plan.activation_peak), need=format_bytes(need),
                                 capacity=format_bytes(plan.capacity)) + (f" to at most {tokens}" if tokens else "")
    return E.FIX_SMALL.format(weights=format_bytes(weights), capacity=format_bytes(plan.capacity))


def size_num_seqs(plan: MemoryPlan, length: int, slot_tokens: int, requested: int, tokens: int | None = None) -> int:
    """How many sequences the KV cache holds at once: ``--max-num-seqs`` (``requested``), at most
    the slots of ``slot_tokens`` positions (``length`` plus a draft's look-ahead) that the budget's
    ``tokens`` hold; at least one, since ``size_max_model_len`` made one fit."""
    tokens = plan.kv_tokens if tokens is None else tokens
    fits = max(1, tokens // slot_tokens)
    if fits < requested:
        log.warning(SEQS_LOWERED.format(want=requested, seqs=fits, tokens=tokens, length=length))
    return min(requested, fits)
