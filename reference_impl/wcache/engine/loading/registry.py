"""``--load-format`` names and the loader class behind each."""

from __future__ import annotations

from wcache.core.config import EngineConfig
from wcache.engine.loading.base import LoadedWeights, WeightLoader
from wcache.engine.loading.disk import DiskLoader
from wcache.engine.loading.ipc_cache import IpcCacheLoader

LOADERS: dict[str, type[WeightLoader]] = {"auto": DiskLoader, "safetensors": DiskLoader, "ipc_cache": IpcCacheLoader}


def load_weights(cfg: EngineConfig, load_format: str = "auto", loader_config=None, draft: bool = False) -> LoadedWeights:
    """This rank's weights from the loader of ``load_format``."""
    if load_format not in LOADERS:
        raise ValueError(f"Unknown load format {load_format!r}; choose one of {list(LOADERS)}")
    return LOADERS[load_format](loader_config, draft).load(cfg)
