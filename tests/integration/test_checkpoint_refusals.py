"""Checkpoints the engine would compute differently from transformers are refused at start: one line
naming the field, exit status 2, from `wcache serve` and from `wcache preload`.

Every refusal of wcache.core.llama_config.REFUSED (the guide's table) runs through `wcache.cli.main`
in this process, for both commands (the same code path up to the exit status, without an
interpreter start per case); two of them also run as real processes, side by side. The expected
texts are written out here, so a changed message fails until the guide (generated from the code)
and this list agree.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from procs import free_port
from wcache.core.config import EngineConfig
from wcache.core.llama_config import REFUSED, example

EXPECTED = {
    "architectures": ('architectures is ["MistralForCausalLM"]; wcache serves LlamaForCausalLM, Qwen3ForCausalLM '
                      'and Qwen2ForCausalLM only'),
    "model_type": 'model_type is "mistral"; wcache serves model_type llama, qwen3 and qwen2 only',
    "attention_bias": "attention_bias is true; wcache's attention projections have no bias",
    "mlp_bias": "mlp_bias is true; wcache's MLP projections have no bias",
    "sliding_window": "sliding_window is 4096; wcache computes full causal attention, not a sliding window",
    "hidden_act": "hidden_act is \"gelu\"; wcache's MLP computes silu only",
    "rope_parameters.rope_type": 'rope_parameters.rope_type is "yarn"; wcache computes the default, linear and '
                                 "llama3 RoPE types only",
    "rope_scaling.type": 'rope_scaling.type is "dynamic"; wcache computes the default, linear and llama3 RoPE types only',
    "rope_parameters.low_freq_factor": "rope_parameters.low_freq_factor is missing; the llama3 RoPE type needs positive "
                                       "factor, low_freq_factor and high_freq_factor, with high_freq_factor > "
                                       "low_freq_factor",
    "partial_rotary_factor": "partial_rotary_factor is 0.5; wcache rotates every dimension of a head",
    "dtype": 'dtype is "float64"; wcache computes in bfloat16, float16 or float32: choose one with --dtype',
    "torch_dtype": 'torch_dtype is "float64"; wcache computes in bfloat16, float16 or float32: choose one with --dtype',
    "head_dim": "head_dim is 33; RoPE rotates pairs of dimensions, so head_dim must be even",
    "num_key_value_heads": "num_key_value_heads is 3; num_attention_heads must be a multiple of it",
    "hidden_size": "hidden_size is missing; config.json must give it as a positive integer",
}
REAL_PROCESSES = ("attention_bias", "rope_scaling.type")


def message(model: Path, field: str) -> str:
    return f"Unsupported checkpoint {model / 'config.json'}: {EXPECTED[field]}"


@pytest.fixture(scope="module")
def refused(tmp_path_factory) -> dict[str, Path]:
    """A model directory per refusal: the example config.json beside nothing else (refused first)."""
    root = tmp_path_factory.mktemp("refused")
    dirs = {}
    for field in REFUSED:
        d = root / field.replace(".", "-")
        d.mkdir()
        (d / "config.json").write_text(json.dumps(example(field), indent=2))
        dirs[field] = d
    return dirs


def serve(model, *extra):
    return ["serve", str(model), "--device", "cpu", "--host", "127.0.0.1", "--port", str(free_port()), *extra]


def preload(model, *extra):
    return ["preload", "--model", str(model), "--device", "cpu", *extra]


def check_one_line(code: int, out: str, expected: str) -> None:
    assert code == 2, f"exit {code}\n{out}"
    lines = out.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ERROR ") and lines[0].endswith(f"] {expected}"), out


def test_every_refusal_of_the_guide_is_listed_here():
    assert set(EXPECTED) == set(REFUSED)


@pytest.mark.parametrize("field", list(EXPECTED))
def test_serve_and_preload_refuse_with_one_line_naming_the_field(main, refused, field, wcache_env):
    model = refused[field]
    check_one_line(*main(*serve(model)), message(model, field))
    check_one_line(*main(*preload(model)), message(model, field))


def test_real_processes_exit_2_with_the_line(refused, module_env):
    cases = [(field, make(refused[field])) for field in REAL_PROCESSES for make in (serve, preload)]

    def run(args):
        p = subprocess.run([sys.executable, "-m", "wcache.cli", *args], check=False, env=module_env,
                           capture_output=True, text=True, timeout=180)
        return p.returncode, p.stdout + p.stderr

    with ThreadPoolExecutor(max_workers=len(cases)) as pool:
        results = list(pool.map(run, [args for _, args in cases]))
    for (field, _), (code, out) in zip(cases, results):
        check_one_line(code, out, message(refused[field], field))


def test_an_explicit_dtype_serves_a_float64_checkpoint(refused, tmp_path):
    """Only --dtype auto takes the checkpoint's float64; another --dtype casts the weights, as
    transformers' from_pretrained(dtype=...) does."""
    model = tmp_path / "f64"
    shutil.copytree(refused["dtype"], model)
    assert EngineConfig.build(str(model), "float32", None, "cpu").dtype_name == "float32"
