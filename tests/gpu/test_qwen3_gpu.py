"""Qwen3 on a GPU through the weight cache: the `qwen3-tiny` preset in bfloat16 and in block-wise FP8
(`-q fp8`, the layout of Qwen3-8B-FP8; on Hopper its projections run as FP8 matmuls), served by an
engine reading the disk and by one mapping a `wcache preload` daemon's weights: both answer the same
greedy tokens, with text from the checkpoint's tokenizer. A few seconds each; the engines take 15%
of the card (--gpu-memory-utilization), so the GPU tier can run these beside other tests.
tests/integration/test_qwen3_serving.py runs the same on CPU and against transformers."""

from __future__ import annotations

import json

import pytest
import torch
from procs import Processes, complete

from wcache.core.checkpoint import make_checkpoint

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run `make test-gpu` on a GPU host)"),
]

ENGINE = ("--gpu-memory-utilization", "0.15", "--max-model-len", "128", "--no-enable-autotune")
PROMPT = "The weight cache keeps"


@pytest.fixture
def gpu(tmp_path, wcache_env):
    p = Processes(tmp_path, wcache_env, device="cuda")
    yield p
    p.stop_all()


@pytest.mark.parametrize("quantization", ["none", "fp8"])
def test_qwen3_from_the_cache_answers_as_from_disk(gpu, tmp_path, quantization):
    model = make_checkpoint(tmp_path / f"qwen3-{quantization}", "qwen3-tiny", quantization=quantization)
    disk = gpu.serve(model, *ENGINE, name="disk")
    gpu.preload(model, "--no-enable-autotune")  # its sockets under this test's own TMPDIR (wcache_env)
    cached = gpu.serve(model, *ENGINE, "--load-format", "ipc_cache", "--model-loader-extra-config",
                       json.dumps({"fallback": False}), name="cached")
    assert "from disk" in disk.log() and "(zero_copy mode)" in cached.log(), cached.log()
    if quantization == "fp8":
        assert "Mapped 51 tensors" in cached.log()  # FP8 weights, their block scales, the q/k norms
    answers = [complete(p.port, PROMPT, 16)["choices"][0] for p in (disk, cached)]
    assert answers[0]["token_ids"] == answers[1]["token_ids"] and answers[0]["text"] == answers[1]["text"]
    assert answers[0]["text"] and len(answers[0]["token_ids"]) >= 1
