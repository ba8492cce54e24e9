"""The engine configuration that the daemon and the engine build identically from the same flags.

Built without torch: `wcache preload`'s launcher builds it to plan the ranks, and only its ranks
import torch (each replica of a fan-out paid about 2 s of CPU for that import on a 2-core host). The
torch-typed views (``dtype``, ``torch_device``, ``shape``) import it when first asked, in a rank.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

from wcache.core import checkpoint_files, llama_config
from wcache.core.device import cuda_available, cuda_device_count
from wcache.errors import DeviceError
from wcache.model import quant

if TYPE_CHECKING:
    import torch

    from wcache.model.llama import ModelShape

DTYPE_CHOICES = ["auto", *checkpoint_files.DTYPE_NAMES]


def model_config(model: str, dtype: str = "auto") -> tuple[dict, str]:
    """(config.json resolved, the compute dtype's name): what the engine refuses a checkpoint for,
    read without torch, so the front of a two-process `wcache serve` refuses it as the engine would."""
    hf = checkpoint_files.read_config(model)
    name = (llama_config.auto_dtype(hf, Path(model) / "config.json", lambda: checkpoint_files.stored_dtype(model))
            if dtype == "auto" else dtype)
    if name not in checkpoint_files.DTYPE_NAMES:
        raise ValueError(f"Unsupported dtype {name!r}; choose one of {DTYPE_CHOICES}")
    return hf, name


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
        return "cuda" if cuda_available() else "cpu"
    if choice == "cuda" and not cuda_available():
        raise DeviceError(DeviceError.NO_CUDA)
    if choice not in ("cuda", "cpu"):
        raise ValueError(f"Unknown device {choice!r}; choose auto, cuda or cpu")
    return choice


@dataclass(frozen=True)
class EngineConfig:
    model: str
    hf: dict = field(repr=False)
    dtype_name: str  # one of checkpoint_files.DTYPE_NAMES; ``dtype`` is its torch type
    quant: quant.QuantMethod = field(repr=False)
    device: str = "cpu"
    ranks: Ranks = Ranks()
    revision: str = "main"

    @classmethod
    def build(cls, model: str, dtype: str = "auto", quantization: str | None = None, device: str = "auto",
              ranks: Ranks = Ranks(), revision: str | None = None) -> "EngineConfig":
        hf, name = model_config(model, dtype)
        return cls(model=str(model), hf=hf, dtype_name=name, quant=quant.resolve(quantization, hf, str(Path(model) / "config.json")),
                   device=resolve_device(device), ranks=ranks, revision=revision or "main")

    @classmethod
    def from_spec(cls, spec: dict) -> "EngineConfig":
        """The configuration a launcher hands a rank process (daemon or engine worker) as JSON."""
        return cls.build(spec["model"], spec["dtype"], spec["quantization"], spec["device"],
                         ranks=Ranks(**spec["ranks"]), revision=spec.get("revision"))

    def for_rank(self, ranks: Ranks) -> "EngineConfig":
        return replace(self, ranks=ranks)

    @property
    def dtype(self) -> torch.dtype:
        import torch

        return getattr(torch, self.dtype_name)

    @property
    def shape(self) -> ModelShape:
        from wcache.model.llama import ModelShape

        r = self.ranks
        return ModelShape.from_config(self.hf, tp_size=r.tp_size, pp_size=r.pp_size, pp_rank=r.pp_rank)

    @property
    def torch_device(self) -> torch.device:
        import torch

        if self.device == "cuda":
            return torch.device("cuda", self.ranks.local_rank % max(cuda_device_count(), 1))
        return torch.device("cpu")

