"""Reading a model directory without torch: its config.json, the dtype its shards store and the
list of its shards.

`wcache preload`'s launcher plans ranks from these and imports no torch (each replica of a fan-out
paid about 2 s of CPU for that import on a 2-core host: docs/benchmarks.md, weight seeding); the
writer of deterministic checkpoints is core/checkpoint.py.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from wcache.core import llama_config, shard_header
from wcache.errors import CHECKPOINT_UNUSABLE, UserError

# The compute dtypes by the names config.json and --dtype use (core/checkpoint.py's DTYPES holds
# their torch types; tests/unit/test_flag_defaults.py checks the two agree).
DTYPE_NAMES = ("bfloat16", "float16", "float32")


class CheckpointError(UserError):
    pass


def read_config(model_dir: str | os.PathLike) -> dict:
    """config.json with every field the engine reads resolved (llama_config.normalize), or a refusal."""
    path = Path(model_dir) / "config.json"
    if not Path(model_dir).is_dir():
        what = "no such directory" if not Path(model_dir).exists() else "not a directory"
        raise CheckpointError(f"Model directory {model_dir}: {what}")
    if not path.is_file():
        raise CheckpointError(f"No config.json in {model_dir}: not a model directory")
    try:
        raw = json.loads(path.read_text())
    except ValueError as e:
        raise CheckpointError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(raw, dict):
        raise CheckpointError(f"{path} is not a JSON object")
    return llama_config.normalize(raw, path)


# safetensors header dtypes -> the names config.json uses
STORED_DTYPES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32", "F64": "float64"}


def stored_dtype(model_dir: str | os.PathLike) -> str | None:
    """The dtype of the first floating-point tensor of the first shard, read from its header: what
    transformers takes when config.json names no dtype."""
    path = shard_files(model_dir)[0]
    try:
        with open(path, "rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    except (OSError, ValueError) as e:
        raise CheckpointError(f"Cannot read the safetensors header of {path}: {e}") from None
    for name, entry in header.items():
        # FP8 checkpoints keep float32 block scales beside FP8 weights: the scales say nothing.
        if name != "__metadata__" and entry["dtype"] in STORED_DTYPES and not name.endswith("_scale_inv"):
            return STORED_DTYPES[entry["dtype"]]
    return None


def shard_files(model_dir: str | os.PathLike, whole: bool = True) -> list[Path]:
    """The checkpoint's safetensors files, sorted; the index (when present) must agree. Each is a
    whole safetensors file (core/shard_header.py), unless ``whole`` is False: the checkpoint's digest
    hashes the bytes as they are, and the load that follows it checks them."""
    d = Path(model_dir)
    index = d / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [d / n for n in names]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"Shards listed in {index} are missing: {missing}")
    else:
        files = sorted(d.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"No *.safetensors files in {model_dir}")
    for f in files if whole else ():
        try:
            shard_header.check_shard(f)
        except (shard_header.BadShard, OSError) as e:
            raise CheckpointError(CHECKPOINT_UNUSABLE.format(model=model_dir, why=e)) from None
    return files
