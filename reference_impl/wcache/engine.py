"""The engine: a model bound to weights from disk or from the weight cache, and greedy completion."""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

from . import tokenizer
from .config import EngineConfig
from .model import Llama, bind_weights, build_meta_model, generate
from .postprocess import ProcessedWeights

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


def load_weights(cfg: EngineConfig, load_format: str = "auto", loader_config=None) -> tuple[ProcessedWeights, LoadReport]:
    """Weights for this rank from the requested source, timed from start to bindable tensors."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"Unknown load format {load_format!r}; choose one of {LOAD_FORMATS}")
    t0 = time.perf_counter()
    if load_format == "ipc_cache":
        from .loader import load_from_cache  # the weight-cache client

        weights, report = load_from_cache(cfg, loader_config)
        if weights is not None:
            report.seconds = time.perf_counter() - t0
            return weights, report
        fallback_reason = report.fallback_reason
    else:
        fallback_reason = None
    from .disk import load_processed

    weights = load_processed(cfg)
    report = LoadReport("disk", time.perf_counter() - t0, len(weights.tensors), weights.nbytes,
                        fallback_reason=fallback_reason)
    return weights, report


class Engine:
    def __init__(self, cfg: EngineConfig, load_format: str = "auto", loader_config=None, max_model_len: int | None = None):
        self.cfg = cfg
        self.weights, self.report = load_weights(cfg, load_format, loader_config)
        self.model: Llama = bind_weights(build_meta_model(cfg.shape, cfg.quant, cfg.dtype), self.weights.bindable())
        self.max_model_len = min(max_model_len or 2048, cfg.shape.max_positions)
        self._lock = threading.Lock()  # one sequence at a time: the KV cache is per request
        log.info("Loaded %d tensors (%.1f MiB) from %s in %.3f s", self.report.tensors,
                 self.report.nbytes / 2**20, self.report.source, self.report.seconds)

    def close(self) -> None:
        for lease in self.report.keepalive:  # zero_copy: tell the daemon we no longer map its memory
            lease.close()
        self.report.keepalive.clear()

    def complete(self, prompt: str, max_tokens: int) -> tuple[str, list[int], str, int]:
        ids = tokenizer.encode(prompt)
        with self._lock:
            out = generate(self.model, ids, max_tokens, eos_id=tokenizer.EOS_ID)
        finish = "stop" if out and out[-1] == tokenizer.EOS_ID else "length"
        return tokenizer.decode(out), out, finish, len(ids)
