"""examples/verify_checkpoint.py (the image's wcache-verify-checkpoint): a complete checkpoint passes,
and each way of being incomplete fails with its own line, as the Kubernetes init container and copy
Job rely on. Runs the script as the containers do, in a subprocess, on a real checkpoint."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys

import pytest
from dockerlib import ROOT

SCRIPT = ROOT / "examples" / "verify_checkpoint.py"


def verify(directory, *flags) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), str(directory), *flags], capture_output=True, text=True,
                          timeout=60)


@pytest.fixture
def model(tiny_model, tmp_path):
    d = tmp_path / "llama"
    shutil.copytree(tiny_model, d)
    return d


def shards(d):
    return sorted(d.glob("*.safetensors"))


def test_a_complete_checkpoint_passes(model):
    r = verify(model)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == f"Checkpoint {model} is complete: {len(shards(model))} shard(s), 39 tensors"


@pytest.mark.parametrize("damage, message", [
    ("truncate", "is {size} bytes; its header describes {full} (truncated or still being copied?)"),
    ("remove", "{name}: the file is missing"),
    ("config", "config.json is missing"),
    ("index", "model.safetensors.index.json is not a safetensors index"),
])
def test_an_incomplete_checkpoint_fails_with_its_reason(model, damage, message):
    shard = shards(model)[-1]
    full = shard.stat().st_size
    if damage == "truncate":
        shard.write_bytes(shard.read_bytes()[:-10])
    elif damage == "remove":
        shard.unlink()
    elif damage == "config":
        (model / "config.json").unlink()
    else:
        (model / "model.safetensors.index.json").write_text("{}")
    r = verify(model)
    assert r.returncode == 1 and r.stdout == ""
    expected = message.format(size=full - 10, full=full, name=shard.name)
    assert r.stderr.startswith(f"Checkpoint {model} is not usable: ") and expected in r.stderr, r.stderr


def test_sha256_checks_every_listed_file(model):
    names = ["config.json", *(p.name for p in shards(model))]
    sums = "".join(f"{hashlib.sha256((model / n).read_bytes()).hexdigest()}  {n}\n" for n in names)
    r = verify(model, "--sha256")
    assert r.returncode == 1 and "--sha256 was given but SHA256SUMS is not there" in r.stderr
    (model / "SHA256SUMS").write_text(sums)
    r = verify(model, "--sha256")
    assert r.returncode == 0 and r.stdout.strip().endswith(f", {len(names)} file(s) match SHA256SUMS"), r.stderr
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "changed": True}))  # same files, other bytes
    r = verify(model, "--sha256")
    assert r.returncode == 1 and "config.json does not match its SHA-256 in SHA256SUMS" in r.stderr
