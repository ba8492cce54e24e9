"""The engine configuration that the daemon and the engine build identically from the same flags."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from wcache.core import checkpoint, llama_config
from wcache.core.device import cuda_device_count
from wcache.model import quant
from wcache.errors import DeviceError
from wcache.model.llama import ModelShape

DTYPE_CHOICES = ["auto", "bfloat16", "float16", "float32"]


@dataclass(frozen=True)
class Ranks:
    """One rank's place in the parallel layout. Global rank = dp*pp*tp + pp*tp + tp (upstream's)."""

    tp_size: int = 1
    pp_size: int = 1
    dp_size: int = 1
    tp_rank: int = 0
    pp_rank: int = 0
    dp_rank: int = 0
    local_rank: int = 0

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size * self.dp_size

    @property
    def global_rank(self) -> int:
        return self.dp_rank * self.pp_size * self.tp_size + self.pp_rank * self.tp_size + self.tp_rank


def resolve_device(choice: str) -> str:
    if choice == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if choice == "cuda" and not torch.cuda.is_available():
        raise DeviceError(DeviceError.NO_CUDA)
    if choice not in ("cuda", "cpu"):
        raise ValueError(f"Unknown device {choice!r}; choose auto, cuda or cpu")
    return choice


@dataclass(frozen=True)
class EngineConfig:
    model: str
    hf: dict = field(repr=False)
    dtype: torch.dtype
    quant: quant.QuantMethod = field(repr=False)
    device: str = "cpu"
    ranks: Ranks = Ranks()
    revision: str = "main"

    @classmethod
    def build(cls, model: str, dtype: str = "auto", quantization: str | None = None, device: str = "auto",
              ranks: Ranks = Ranks(), revision: str | None = None) -> "EngineConfig":
        hf = checkpoint.read_config(model)
        name = (llama_config.auto_dtype(hf, Path(model) / "config.json", lambda: checkpoint.stored_dtype(model))
                if dtype == "auto" else dtype)
        if name not in checkpoint.DTYPES:
            raise ValueError(f"Unsupported dtype {name!r}; choose one of {DTYPE_CHOICES}")
        return cls(model=str(model), hf=hf, dtype=checkpoint.DTYPES[name], quant=quant.resolve(quantization, hf, str(Path(model) / "config.json")),
                   device=resolve_device(device), ranks=ranks, revision=revision or "main")

    @classmethod
    def from_spec(cls, spec: dict) -> "EngineConfig":
        """The configuration a launcher hands a rank process (daemon or engine worker) as JSON."""
        return cls.build(spec["model"], spec["dtype"], spec["quantization"], spec["device"],
                         ranks=Ranks(**spec["ranks"]), revision=spec.get("revision"))

    def for_rank(self, ranks: Ranks) -> "EngineConfig":
        return replace(self, ranks=ranks)

    @property
    def shape(self) -> ModelShape:
        r = self.ranks
        return ModelShape.from_config(self.hf, tp_size=r.tp_size, pp_size=r.pp_size, pp_rank=r.pp_rank)

    @property
    def torch_device(self) -> torch.device:
        if self.device == "cuda":
            return torch.device("cuda", self.ranks.local_rank % max(cuda_device_count(), 1))
        return torch.device("cpu")

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")
