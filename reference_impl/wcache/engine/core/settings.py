"""The engine's settings: what ``wcache serve``'s flags say about the model, its ranks, its memory and
its batches, as one frozen dataclass (built once from the command line by core/settings.py), and
what the engine core process is told (``CoreSettings``).

``rank_specs`` (engine.py) plans the ranks from it and writes each rank's JSON spec; the HTTP side's
flags (host, port, names, API key, drain) are the API server's (engine/api_server/settings.py).
No torch here: the two-process serve's front holds these settings and imports no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from wcache.core.flag_defaults import DEFAULT_MAX_NUM_SEQS, DEFAULT_MAX_WAITING_REQUESTS
from wcache.core.settings import ModelSettings, ParallelSettings


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


@dataclass(frozen=True)
class CoreSettings:
    """What an engine's start-up needs beyond the HTTP side: the engine, the loader's JSON
    (--model-loader-extra-config, parsed where it loads: loading/config.py), --respawn and the log
    level. The two-process front sends exactly this to its engine core (engine/core/core_proc.py):
    the API key is not in it, so it never leaves the front."""

    engine: EngineSettings
    model_loader_extra_config: str | None = None
    respawn: bool = False
    log_level: str = "INFO"
