"""A checkpoint whose weights came from a seed daemon: what a shard-less model directory stands for.

A replica seeded with weights (daemon/weight_pull.py) has the checkpoint's small files (config.json,
the tokenizer, model.safetensors.index.json) but no shard, so neither it nor its engines can hash
the shards for the cache key. The source sends each shard's [size, sha256] with the weights; the
replica checks that the names are those its own index lists and remembers the list under the cache
root, keyed by the model directory. From then on the checkpoint digest of that directory is computed
from the list (and config.json, hashed here as always) by the very formula that hashes real shards,
so the replica's daemon and its engines agree with the source's key. A directory that holds any of
its shards is hashed from the shards and the list is ignored.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path

RECORDS = "seeded"
INDEX = "model.safetensors.index.json"


def _record_path(model_dir: Path, root: Path) -> Path:
    tag = hashlib.sha256(os.path.realpath(model_dir).encode()).hexdigest()[:24]
    return root / RECORDS / f"{tag}.json"


def listed_shards(model_dir: Path) -> list[str]:
    """The shard names the index lists (empty without an index)."""
    index = Path(model_dir) / INDEX
    if not index.is_file():
        return []
    try:
        return sorted(set(json.loads(index.read_text())["weight_map"].values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return []


def has_shards(model_dir: Path) -> bool:
    """Whether the directory holds its checkpoint's shards (every shard the index lists, or any
    *.safetensors file where there is no index)."""
    model_dir = Path(model_dir)
    names = listed_shards(model_dir)
    if names:
        return all((model_dir / n).is_file() for n in names)
    return any(model_dir.glob("*.safetensors"))


def config_entry(model_dir: Path) -> list:
    """config.json's [size, sha256]: hashed where it lies, seeded or not."""
    data = (Path(model_dir) / "config.json").read_bytes()
    return [len(data), hashlib.sha256(data).hexdigest()]


def small_identity(model_dir: Path) -> dict:
    """What a seed and its replica compare of their small files: config.json and the shard names."""
    model_dir = Path(model_dir)
    return {"config_sha256": config_entry(model_dir)[1], "shards": listed_shards(model_dir)}


def write(model_dir: Path, root: Path, shards: dict[str, list], source: str) -> None:
    """Remember the source's shard list for this directory (atomically; 0600)."""
    path = _record_path(Path(model_dir), root)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
    with os.fdopen(fd, "w") as f:
        json.dump({"model": os.path.realpath(model_dir), "shards": shards, "source": source}, f)
    os.replace(tmp, path)


def digest(model_dir: Path, root: Path, combine) -> tuple[str, dict, dict] | None:
    """(digest, stats, each file's [size, sha256]) of a shard-less directory a replica seeded, or None: where a shard is present,
    no list was remembered, or the list names other shards than the index does."""
    names = listed_shards(model_dir)
    if not names or any((model_dir / n).is_file() for n in names):
        return None
    try:
        record = json.loads(_record_path(model_dir, root).read_text())
        shards = record["shards"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not isinstance(shards, dict) or sorted(shards) != names:
        return None
    entries = {**shards, "config.json": config_entry(model_dir)}
    return combine(entries), {"files": len(entries), "files_hashed": 1, "bytes_hashed": entries["config.json"][0],
                              "files_unsettled": 0}, entries
