"""The engine's ordinary load path: read safetensors shards, then post-process for this rank."""

from __future__ import annotations

import logging
import time

import torch
from safetensors import safe_open
from tqdm import tqdm

from wcache.core import checkpoint_files, fp8_check
from wcache.core.config import EngineConfig
from wcache.core.postprocess import ProcessedWeights, needed_checkpoint_names, postprocess

log = logging.getLogger("wcache.disk")


def read_checkpoint(cfg: EngineConfig, show_progress: bool = True) -> dict[str, torch.Tensor]:
    wanted = set(needed_checkpoint_names(cfg.shape, cfg.quant))
    device = str(cfg.torch_device)
    raw: dict[str, torch.Tensor] = {}
    files = checkpoint_files.shard_files(cfg.model)  # each a whole safetensors file (core/shard_header.py)
    fp8_check.check(cfg.model, files, cfg.quant)  # before any tensor is read onto the device
    for path in tqdm(files, desc="Loading safetensors checkpoint shards", unit="shard", disable=not show_progress):
        with safe_open(str(path), framework="pt", device=device) as f:
            for name in f.keys():
                # An FP8 tensor the model keeps unquantized brings its block scale along (postprocess
                # up-casts it once).
                if name in wanted or name.removesuffix("_scale_inv") in wanted:
                    raw[name] = f.get_tensor(name)
    missing = sorted(wanted - set(raw))
    if missing:
        raise checkpoint_files.CheckpointError(f"Checkpoint {cfg.model} lacks tensors: {missing[:5]}")
    return raw


def load_processed(cfg: EngineConfig, show_progress: bool = True) -> ProcessedWeights:
    t0 = time.perf_counter()
    cfg.quant.check_loadable()  # before reading: a method the engine cannot run is refused at once
    raw = read_checkpoint(cfg, show_progress)
    weights = postprocess(raw, cfg.shape, cfg.quant, cfg.dtype, tp_rank=cfg.ranks.tp_rank)
    if cfg.device == "cuda":
        torch.cuda.synchronize(cfg.torch_device)
    log.debug("read and post-processed %d tensors in %.3f s", len(weights.tensors), time.perf_counter() - t0)
    return weights
