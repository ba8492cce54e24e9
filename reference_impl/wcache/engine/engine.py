"""The engine: a model bound to weights from disk or from the weight cache, and greedy completion."""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

from wcache.core import autotune
from wcache.engine import memory
from wcache.model import tokenizer
from wcache.core.config import EngineConfig
from wcache.model.llama import Llama, bind_weights, build_meta_model, generate
from wcache.core.postprocess import ProcessedWeights

log = logging.getLogger("wcache.engine")

LOAD_FORMATS = ["auto", "safetensors", "ipc_cache"]


@dataclass
class LoadReport:
    source: str  # "disk" or "weight cache (zero_copy)" / "weight cache (copy)"
    seconds: float
    tensors: int
    nbytes: int
    external_bytes: int = 0  # weights held by the daemon and mapped, not owned, by this engine
    fallback_reason: str | None = None
    keepalive: list = field(default_factory=list, repr=False)
    phases: dict = field(default_factory=dict)  # seconds per handoff step (cache loads only)
    transport: str | None = None  # the arena kind a cache load came through (memfd, cuda_ipc, cuda_vmm_fd)


def load_weights(cfg: EngineConfig, load_format: str = "auto", loader_config=None,
                 draft: bool = False) -> tuple[ProcessedWeights, LoadReport]:
    """Weights for this rank from the requested source, timed from start to bindable tensors.
    ``draft``: a speculative draft model, served by the draft daemon group's ``_draft`` sockets."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"Unknown load format {load_format!r}; choose one of {LOAD_FORMATS}")
    t0 = time.perf_counter()
    if load_format == "ipc_cache":
        from wcache.engine.loader import load_from_cache  # the weight-cache client

        weights, report = load_from_cache(cfg, loader_config, draft=draft)
        if weights is not None:
            report.seconds = time.perf_counter() - t0
            return weights, report
        fallback_reason = report.fallback_reason
    else:
        fallback_reason = None
    from wcache.core.disk import load_processed

    weights = load_processed(cfg)
    report = LoadReport("disk", time.perf_counter() - t0, len(weights.tensors), weights.nbytes,
                        fallback_reason=fallback_reason)
    return weights, report


class Engine:
    def __init__(self, cfg: EngineConfig, load_format: str = "auto", loader_config=None, max_model_len: int | None = None,
                 gpu_memory_utilization: float = memory.DEFAULT_UTILIZATION, cpu_memory_capacity: int | None = None,
                 enable_autotune: bool = True):
        self.cfg = cfg
        self.weights, self.report = load_weights(cfg, load_format, loader_config)
        self.model: Llama = bind_weights(build_meta_model(cfg.shape, cfg.quant, cfg.dtype), self.weights.bindable())
        self._lock = threading.Lock()  # one sequence at a time: they share the KV cache
        log.info("Loaded %d tensors (%.1f MiB) from %s in %.3f s", self.report.tensors,
                 self.report.nbytes / 2**20, self.report.source, self.report.seconds)
        try:
            self._size_memory(max_model_len, gpu_memory_utilization, cpu_memory_capacity, enable_autotune)
        except BaseException:
            self.close()
            raise

    def _size_memory(self, max_model_len, utilization, cpu_capacity, enable_autotune) -> None:
        """Autotune, then split the memory budget (memory.py) and allocate the KV cache it leaves."""
        cfg = self.cfg
        external = memory.external_weights(self.report)  # the daemon's own count (get_memory)
        capacity = memory.device_capacity(cfg.torch_device, cpu_capacity)
        memory.check_external(capacity, utilization, external)
        # Tune first: the profiling forward below then measures the activations of the winners.
        self.autotune = autotune.prepare_engine(cfg, self.model, enable_autotune)
        want = min(max_model_len or 2048, cfg.shape.max_positions)
        self.memory = memory.MemoryPlan(
            device=cfg.device, capacity=capacity, utilization=utilization,
            own_weights=self.report.nbytes - self.report.external_bytes, external_weights=external,
            activation_peak=memory.measure_activation_peak(self.model, want),
            kv_bytes_per_token=memory.kv_bytes_per_token(cfg.shape, cfg.dtype))
        if external:
            log.info(memory.HELD_OUTSIDE.format(external=memory.format_bytes(external), split=self.memory.split()))
        else:
            log.info(memory.BUDGET.format(split=self.memory.split()))
        log.info(memory.PLAN_JSON.format(json=self.memory.as_json()))
        self.max_model_len = memory.size_max_model_len(self.memory, max_model_len, 2048, cfg.shape.max_positions)
        self.kv_cache = self.model.new_cache(self.max_model_len)  # one sequence at a time reuses it
        log.info("KV cache: %d tokens allocated (%s) for --max-model-len %d; the budget holds %d",
                 self.max_model_len, memory.format_bytes(self.max_model_len * self.memory.kv_bytes_per_token),
                 self.max_model_len, self.memory.kv_tokens)

    def close(self) -> None:
        for lease in self.report.keepalive:  # zero_copy: tell the daemon we no longer map its memory
            lease.close()
        self.report.keepalive.clear()

    def complete(self, prompt: str, max_tokens: int) -> tuple[str, list[int], str, int]:
        ids = tokenizer.encode(prompt)
        with self._lock:
            out = generate(self.model, ids, max_tokens, eos_id=tokenizer.EOS_ID, cache=self.kv_cache)
        finish = "stop" if out and out[-1] == tokenizer.EOS_ID else "length"
        return tokenizer.decode(out), out, finish, len(ids)
