"""Broken safetensors files and FP8 checkpoints with wrong types or scale values are refused at start:
exit status 2 with one line naming the file (and the tensor), from `wcache serve`, `wcache preload`,
a daemon rank and the loader; never a SafetensorError traceback, never degenerate tokens.

Each damage is made on a copy of a real checkpoint, the way the attack round made it (a shard cut
short, a header length rewritten, a scale tensor rewritten with safetensors); the commands run in
this process through `wcache.cli.main` (the same code path up to the exit status), and a few as
real processes, a daemon rank among them.
"""

from __future__ import annotations

import json
import os
import select
import shutil
import struct
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
from procs import free_port
from safetensors.torch import load_file, save_file
from wcache.core.checkpoint import make_checkpoint
from wcache.core.config import EngineConfig, Ranks
from wcache.engine.loading.registry import load_weights
from wcache.errors import QuantizationError

LAST = "model-00002-of-00002.safetensors"  # the tiny preset's second shard


def _header_length(path: Path, length: int) -> None:
    b = path.read_bytes()
    path.write_bytes(struct.pack("<Q", length) + b[8:])


def _header_text(path: Path, text: bytes) -> None:
    b = path.read_bytes()
    (length,) = struct.unpack("<Q", b[:8])
    path.write_bytes(b[:8] + text.ljust(length)[:length] + b[8 + length:])


def _offsets_past_end(path: Path) -> None:
    b = path.read_bytes()
    (length,) = struct.unpack("<Q", b[:8])
    header = json.loads(b[8:8 + length])
    name = sorted(k for k in header if k != "__metadata__")[-1]
    header[name]["data_offsets"] = [header[name]["data_offsets"][0] + 10**9, header[name]["data_offsets"][1] + 10**9]
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + b[8 + length:])


# damage -> (how, the problem the line names; {size} is the damaged file's size, {full} the whole one's)
SHARD_DAMAGE = {
    "truncated": (lambda p: p.write_bytes(p.read_bytes()[:-1000]),
                  "the file is {size} bytes; its header describes {full} (truncated or still being copied?)"),
    "header length 2^63-1": (lambda p: _header_length(p, 2**63 - 1),
                             f"header of {2**63 - 1} bytes does not fit in its {{size}} bytes"),
    "header length 1e12": (lambda p: _header_length(p, 10**12), f"header of {10**12} bytes does not fit in its {{size}} bytes"),
    "length past the file": (lambda p: _header_length(p, p.stat().st_size),
                             "header of {full} bytes does not fit in its {size} bytes"),
    "non-JSON header": (lambda p: _header_text(p, b"{not json"),
                        "header is not JSON (Expecting property name enclosed in double quotes: line 1 column 2 (char 1))"),
    "offsets past the end": (_offsets_past_end, "tensor"),  # the entry's bytes no longer match: see below
    "empty file": (lambda p: p.write_bytes(b""), "the file is 0 bytes: too short for a safetensors header"),
}


def damaged(root: Path, model: Path, name: str, how) -> tuple[Path, int]:
    d = root / name.replace(" ", "-").replace("^", "")
    shutil.copytree(model, d)
    full = (d / LAST).stat().st_size
    how(d / LAST)
    return d, full


def check_one_line(code: int, out: str, expected: str) -> None:
    assert code == 2, f"exit {code}\n{out}"
    lines = [line for line in out.strip().splitlines() if not line.startswith("INFO ")]
    assert len(lines) == 1 and lines[0].startswith("ERROR ") and "[wcache.cli] " in lines[0], out
    assert lines[0].endswith(expected), f"{lines[0]!r}\ndoes not end with\n{expected!r}"
    assert "Traceback" not in out and "SafetensorError" not in out, out


def serve(model, *extra):
    return ["serve", str(model), "--device", "cpu", "--host", "127.0.0.1", "--port", str(free_port()), *extra]


def preload(model, *extra):
    return ["preload", "--model", str(model), "--device", "cpu", *extra]


@pytest.mark.parametrize("damage", list(SHARD_DAMAGE))
def test_a_broken_shard_stops_serve_and_preload_with_one_line_naming_it(main, tiny_model, tmp_path, damage,
                                                                        wcache_env):
    how, problem = SHARD_DAMAGE[damage]
    model, full = damaged(tmp_path, tiny_model, damage, how)
    size = (model / LAST).stat().st_size
    problem = problem.format(size=size, full=full)
    if damage == "offsets past the end":  # the moved entry still fits its shape; the file no longer holds it
        problem = f"the file is {size} bytes; its header describes "
    for command in (serve(model), preload(model)):
        code, out = main(*command)
        expected = f"Checkpoint {model} is not usable: {LAST}: {problem}"
        if damage == "offsets past the end":
            assert expected in out and "(truncated or still being copied?)" in out, out
            # the rest of the line, whatever the header's figures; the line that names the shard, not the output's
            # last line (in CI an INFO line once came after it, which check_one_line allows)
            [line] = [x for x in out.splitlines() if expected in x]
            expected = line[line.index(expected):]
        check_one_line(code, out, expected)


def test_a_daemon_rank_and_real_processes_name_the_broken_shard(tiny_model, tmp_path, wcache_env):
    model, full = damaged(tmp_path, tiny_model, "truncated", SHARD_DAMAGE["truncated"][0])
    expected = (f"Checkpoint {model} is not usable: {LAST}: the file is {full - 1000} bytes; its header describes "
                f"{full} (truncated or still being copied?)")
    for command in (serve(model), preload(model)):
        p = subprocess.run([sys.executable, "-m", "wcache.cli", *command], env=wcache_env, capture_output=True,
                           text=True, timeout=180, check=False)
        check_one_line(p.returncode, p.stdout + p.stderr, expected)
    # A rank as the launcher starts it (what a launcher that skipped its own check would meet).
    r, w = os.pipe()
    spec = {"model": str(model), "dtype": "auto", "quantization": None, "device": "cpu", "revision": None,
            "socket_dir": None, "transport": "auto", "adopt": False, "autotune": False, "log_level": "INFO",
            "ranks": asdict(Ranks()), "ready_fd": w}
    rank = subprocess.run([sys.executable, "-m", "wcache.daemon.rank"], pass_fds=(w,), capture_output=True, text=True,
                          env={**wcache_env, "WCACHE_RANK_SPEC": json.dumps(spec)}, timeout=180, check=False)
    assert not select.select([r], [], [], 0)[0] or not os.read(r, 1)  # it never said ready
    assert rank.returncode == 2, rank.stderr
    errors = [line for line in rank.stderr.splitlines() if line.startswith("ERROR")]
    assert len(errors) == 1 and errors[0].endswith(expected) and "Traceback" not in rank.stderr, rank.stderr


# -- FP8 ----------------------------------------------------------------------------------------
SCALE = "model.layers.0.mlp.down_proj.weight_scale_inv"  # in the first shard of the tiny preset
WEIGHT = SCALE.removesuffix("_scale_inv")
FIRST = "model-00001-of-00002.safetensors"


def _fill(value):
    return lambda t: {SCALE: torch.full_like(t[SCALE], value)}


FP8_DAMAGE = {  # damage -> (the tensors it rewrites, the line's end)
    "NaN scale": (_fill(float("nan")), f"{SCALE} in {FIRST} holds nan at [0, 0]; block scales must be finite and positive"),
    "inf scale": (_fill(float("inf")), f"{SCALE} in {FIRST} holds inf at [0, 0]; block scales must be finite and positive"),
    "zero scale": (_fill(0.0), f"{SCALE} in {FIRST} holds 0.0 at [0, 0]; block scales must be finite and positive"),
    "negative scale": (_fill(-1e30), f"{SCALE} in {FIRST} holds -1.0000000150474662e+30 at [0, 0]; block scales must "
                                     "be finite and positive"),
    "int32 scale": (lambda t: {SCALE: t[SCALE].to(torch.int32)},
                    f"{SCALE} in {FIRST} is I32; block scales must be float32 (F32)"),
    "e5m2 weight": (lambda t: {WEIGHT: t[WEIGHT].to(torch.float8_e5m2)},
                    f"{WEIGHT} in {FIRST} is F8_E5M2; a weight with a block scale must be float8_e4m3fn (F8_E4M3)"),
    "bf16 weight with a scale": (lambda t: {WEIGHT: t[WEIGHT].to(torch.bfloat16)},
                                 f"{WEIGHT} in {FIRST} is BF16; a weight with a block scale must be float8_e4m3fn "
                                 "(F8_E4M3)"),
}


@pytest.fixture(scope="module")
def fp8_models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("fp8-damage")
    whole = make_checkpoint(root / "whole", "tiny", quantization="fp8")
    models = {}
    for damage, (rewrite, _) in FP8_DAMAGE.items():
        d = root / damage.replace(" ", "-")
        shutil.copytree(whole, d)
        tensors = load_file(d / FIRST)
        save_file({**tensors, **rewrite(tensors)}, d / FIRST, metadata={"format": "pt"})
        models[damage] = d
    return models


@pytest.mark.parametrize("damage", list(FP8_DAMAGE))
def test_fp8_types_and_scale_values_are_refused_by_the_loader_serve_and_preload(main, fp8_models, damage, wcache_env):
    model = fp8_models[damage]
    expected = f"FP8 checkpoint {model}: {FP8_DAMAGE[damage][1]}"
    with pytest.raises(QuantizationError) as refused:
        load_weights(EngineConfig.build(str(model), "auto", None, "cpu"), "safetensors")
    assert str(refused.value) == expected
    check_one_line(*main(*serve(model, "--load-format", "safetensors")), expected)
    check_one_line(*main(*preload(model)), expected)


@pytest.mark.parametrize("block, served", [(7, False), (1_000_000, False), (128, False), (32, True), (16, True)])
def test_make_checkpoint_accepts_only_block_sizes_the_loader_serves(main, tmp_path, block, served):
    out = tmp_path / f"b{block}"
    code, text = main("make-checkpoint", str(out), "--preset", "tiny", "-q", "fp8", "--weight-block-size", str(block))
    if served:
        assert code == 0, text
        load_weights(EngineConfig.build(str(out), "auto", None, "cpu"), "safetensors")  # and it loads
        return
    check_one_line(code, text, "")
    assert f"--weight-block-size {block} makes a checkpoint that wcache cannot serve: Cannot fuse " in text, text
    assert not out.exists()  # refused before anything was written
