"""`wcache bench`'s settings: its flags (add_bench_args in cli/flags.py) as one frozen dataclass,
built once by the command line (core/settings.py) and passed down to every measurement of the run.
Which measurement runs (--respawn, --health-under-load, --seed) the command line decides; it is not
a setting of the measurement."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BenchSettings:
    model: str
    device: str = "auto"
    dtype: str = "auto"
    quantization: str | None = None
    transport: str = "auto"  # the daemon's --weight-cache-transport (CUDA only)
    repeat: int = 3  # samples per source; the median is reported
    json: bool = False  # print the record as JSON instead of a table
    output: str | None = None  # also write the JSON record here
    seed_replicas: int = 4  # --seed: replicas of the fan-out round
    seed_window: float = 3.0  # --seed: the fan-out source's --weight-cache-seed-round-window
