"""The ``safetensors`` (and ``auto``) load format: read and post-process this rank's shard."""

from __future__ import annotations

import time

from wcache.core.config import EngineConfig
from wcache.core.disk import load_processed
from wcache.engine.loading.base import LoadedWeights, LoadReport, WeightLoader


class DiskLoader(WeightLoader):
    def load(self, cfg: EngineConfig, fallback_reason: str | None = None, t0: float | None = None,
             fallback_kind: str | None = None) -> LoadedWeights:
        """``fallback_reason``/``t0``: set by the cache loader when it falls back, so the report says
        why and counts the failed attempt's time too."""
        t0 = time.perf_counter() if t0 is None else t0
        weights = load_processed(cfg)
        report = LoadReport("disk", time.perf_counter() - t0, len(weights.tensors), weights.nbytes,
                            fallback_reason=fallback_reason, fallback_kind=fallback_kind)
        return LoadedWeights(weights, report)
