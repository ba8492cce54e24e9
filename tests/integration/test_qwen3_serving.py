"""Qwen3 through the weight cache on CPU, as the GPU tier runs it (tests/gpu/test_qwen3_gpu.py): the
`qwen3-tiny` preset in bfloat16 and in block-wise FP8 (make-checkpoint `-q fp8`, Qwen3-8B-FP8's
layout), each read once by a `wcache preload` daemon and mapped by an engine, which answers exactly
what an engine reading the disk answers and, for FP8, transformers' greedy ids on the same files
(FineGrainedFP8Config(dequantize=True), float32, as test_fp8_serving.py does for Llama)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from procs import complete
from wcache.core.checkpoint import make_checkpoint
from wcache.model.tokenizer import Tokenizer

HERE = Path(__file__).parent
PROMPT = "The weight cache keeps"
MAX_TOKENS = 12
FLAGS = ("--no-enable-autotune", "--dtype", "float32")


@pytest.fixture(scope="module", params=["none", "fp8"])
def served(request, tmp_path_factory, module_procs, module_env):
    model = make_checkpoint(tmp_path_factory.mktemp("qwen3") / f"qwen3-{request.param}", "qwen3-tiny",
                            quantization=request.param)
    sockets = f"{module_env['TMPDIR']}/q3-{request.param}"
    daemon = module_procs.preload(model, *FLAGS, "--weight-cache-socket-dir", sockets, ready=False,
                                  name=f"daemon-q3-{request.param}")
    disk = module_procs.serve(model, *FLAGS, "--max-model-len", "64", name=f"disk-q3-{request.param}")
    daemon.wait_for_log("Weight cache daemon READY")
    cached = module_procs.serve(model, *FLAGS, "--max-model-len", "64", "--load-format", "ipc_cache",
                                "--model-loader-extra-config", json.dumps({"fallback": False, "socket_dir": sockets}),
                                name=f"cache-q3-{request.param}")
    return request.param, model, disk, cached


def test_qwen3_from_the_cache_answers_as_from_disk_and_as_transformers(served, tmp_path):
    quantization, model, disk, cached = served
    assert "from disk" in disk.log() and "Mapped " in cached.log(), cached.log()
    answers = [complete(p.port, PROMPT, MAX_TOKENS)["choices"][0] for p in (disk, cached)]
    assert answers[0] == answers[1] and answers[0]["text"]
    if quantization == "fp8":
        assert "Mapped 51 tensors" in cached.log()  # tiny FP8's 43 (weights and block scales) and 8 q/k norms
    spec = [{"load": str(model), "out": str(tmp_path), "text": PROMPT, "max_tokens": MAX_TOKENS, "eos_id": 1,
             "fp8_dequantize": quantization == "fp8"}]
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    p = subprocess.run([sys.executable, str(HERE / "hf_reference.py"), str(tmp_path / "spec.json")],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    ref = json.loads((tmp_path / "reference.json").read_text())["float32"]
    assert ref["prompt_ids"] == Tokenizer.load(str(model)).encode(PROMPT)
    assert answers[0]["token_ids"] == ref["greedy"]
