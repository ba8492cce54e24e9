#!/usr/bin/env python3
"""Check that a safetensors checkpoint directory is complete before a daemon loads it.

The image installs this file as `wcache-verify-checkpoint`. The Kubernetes examples run it as an
init container (every pod, before the daemon) and in the Job that copies the checkpoint onto its
volume, so a missing or truncated shard stops the pod with one clear line instead of a loader
traceback after minutes of loading.

    wcache-verify-checkpoint DIR             config.json, the index, every shard it names, and
                                             each shard's size against its own header (fast: it
                                             reads headers only)
    wcache-verify-checkpoint DIR --sha256    also every file listed in DIR/SHA256SUMS (the output
                                             of `sha256sum`), read in full: for the copy Job

Exit status 0 when the checkpoint is complete; 1 with `Checkpoint DIR is not usable: ...` on
stderr otherwise. Each shard is checked by wcache's own code (wcache/core/shard_header.py, standard
library only), so this line names the same problem that `wcache serve` and `wcache preload` stop
with; it runs wherever wcache is installed, as in the image.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

from wcache.core.shard_header import BadShard, check_shard
from wcache.errors import CHECKPOINT_UNUSABLE

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
SUMS = "SHA256SUMS"


class NotUsable(Exception):
    """The checkpoint is incomplete; str() says what is wrong."""


def shards(directory: Path) -> list[str]:
    """The shard files the checkpoint names: the index's weight_map, or the single file."""
    index = directory / INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as e:
            raise NotUsable(f"{INDEX} is not a safetensors index ({e})") from None
        if not isinstance(weight_map, dict) or not weight_map:
            raise NotUsable(f"{INDEX} maps no tensors")
        return sorted(set(weight_map.values()))
    if (directory / SINGLE).is_file():
        return [SINGLE]
    raise NotUsable(f"neither {INDEX} nor {SINGLE} is there")


def check_sums(directory: Path) -> int:
    """The number of files whose SHA-256 matched DIR/SHA256SUMS; NotUsable on the first mismatch."""
    sums = directory / SUMS
    if not sums.is_file():
        raise NotUsable(f"--sha256 was given but {SUMS} is not there (write it with "
                        f"`sha256sum config.json *.json *.safetensors > {SUMS}`)")
    count = 0
    for line in sums.read_text().splitlines():
        if not line.strip():
            continue
        digest, _, name = line.partition("  ")
        name = name.lstrip("*")
        path = directory / name
        if not path.is_file():
            raise NotUsable(f"{name}, listed in {SUMS}, is missing")
        h = hashlib.sha256()
        with path.open("rb") as f:
            while chunk := f.read(16 << 20):
                h.update(chunk)
        if h.hexdigest() != digest.strip().lower():
            raise NotUsable(f"{name} does not match its SHA-256 in {SUMS}")
        count += 1
    return count


def verify(directory: Path, sha256: bool = False) -> str:
    """What was checked, in one line; NotUsable when the checkpoint is not complete."""
    if not directory.is_dir():
        raise NotUsable("it is not a directory (is the volume mounted?)")
    if not (directory / "config.json").is_file():
        raise NotUsable("config.json is missing")
    names = shards(directory)
    tensors = sum(check_shard(directory / n) for n in names)
    line = f"Checkpoint {directory} is complete: {len(names)} shard(s), {tensors} tensors"
    if sha256:
        line += f", {check_sums(directory)} file(s) match {SUMS}"
    return line


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="wcache-verify-checkpoint", description=__doc__.split("\n\n")[0])
    p.add_argument("directory", type=Path)
    p.add_argument("--sha256", action="store_true", help=f"also check every file listed in {SUMS}")
    args = p.parse_args(argv)
    try:
        print(verify(args.directory, args.sha256), flush=True)
    except (NotUsable, BadShard, OSError) as e:
        print(CHECKPOINT_UNUSABLE.format(model=args.directory, why=e), file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
