"""The engine's settings: what ``wcache serve``'s flags say about the model, its ranks, its memory and
its batches, as one frozen dataclass (built once from the command line by core/settings.py).

``rank_specs`` (engine.py) plans the ranks from it and writes each rank's JSON spec; the HTTP side's
flags (host, port, names, API key, drain) are not here: ``run_serve`` still reads those from the
command line's namespace.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from wcache.core.ranks import ParallelSettings
from wcache.core.settings import ModelSettings
from wcache.engine.worker.runner import (
    DEFAULT_MAX_NUM_SEQS,
    DEFAULT_MAX_WAITING_REQUESTS,
)


@dataclass(frozen=True)
class EngineSettings(ModelSettings):
    """`wcache serve`'s engine flags (add_engine_args and add_serve_args in cli/flags.py)."""

    max_model_len: int | None = None
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    max_waiting_requests: int = DEFAULT_MAX_WAITING_REQUESTS
    enforce_eager: bool = False
    gpu_memory_utilization: float = 0.9
    cpu_memory_capacity: int | None = None
    parallel: ParallelSettings = field(default_factory=ParallelSettings)
