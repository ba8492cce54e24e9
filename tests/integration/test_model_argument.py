"""Where a command takes its model, and the longest sequence it may serve, as vLLM's serve does.

`wcache serve DIR` and `wcache serve --model DIR` both work (vLLM's serve takes both); `wcache preload`
takes `--model DIR` only and says so when given a positional directory. A `--max-model-len` past the
model's `max_position_embeddings` is refused before loading, naming both numbers (vLLM refuses it too;
wcache once lowered it to the model's without a word).
"""

from __future__ import annotations

import subprocess
import sys

from procs import _healthy, complete, free_port
from wcache.errors import MaxModelLenError, ModelArgumentError

TINY_POSITIONS = 512  # the tiny preset's max_position_embeddings (core/checkpoint.py PRESETS)


def check(code: int, out: str, message: str) -> None:
    assert code == 2, f"exit {code}\n{out}"
    assert message in out, f"{message!r} not in\n{out}"
    assert "Traceback" not in out, out


def too_long(requested: int) -> str:
    return MaxModelLenError.TOO_LONG.format(requested=requested, derived=TINY_POSITIONS)


def test_serve_takes_the_model_as_a_flag_and_serves(procs, tiny_model):
    """The --model spelling reaches a real engine that answers a completion (it once selected
    --model-loader-extra-config by argparse's abbreviation and failed on the directory as JSON)."""
    port = free_port()
    p = procs.start("serve", "--model", str(tiny_model), "--device", "cpu", "--host", "127.0.0.1",
                    "--port", str(port), "--shutdown-delay", "0")
    p.wait_for(lambda: _healthy(port), what="/health 200")
    assert complete(port)["choices"][0]["text"] is not None
    assert p.stop() == 0


def serve_exit(env, *argv: str) -> tuple[int, str]:
    """A real `wcache serve` that should stop at once (a timeout, not a hang, when it serves instead)."""
    p = subprocess.run([sys.executable, "-m", "wcache.cli", "serve", *argv, "--device", "cpu", "--host", "127.0.0.1",
                        "--port", str(free_port())], env=env, capture_output=True, text=True, timeout=120)
    return p.returncode, p.stdout + p.stderr


def test_a_max_model_len_past_the_model_s_is_refused_naming_both(module_env, tiny_model):
    check(*serve_exit(module_env, "--model", str(tiny_model), "--max-model-len", "100000"), too_long(100000))
    check(*serve_exit(module_env, str(tiny_model), "--max-model-len", str(TINY_POSITIONS + 1)),
          too_long(TINY_POSITIONS + 1))


def test_the_model_given_twice_or_not_at_all(main, module_env, tiny_model, tmp_path):
    check(*main("serve", "--device", "cpu"), ModelArgumentError.SERVE_MISSING)
    other = str(tmp_path / "other")
    check(*main("serve", str(tiny_model), "--model", other, "--device", "cpu"),
          ModelArgumentError.SERVE_TWICE.format(positional=str(tiny_model), flag=other))
    # The same directory both ways is one model: the start goes on (to the length check here).
    check(*serve_exit(module_env, str(tiny_model), "--model", str(tiny_model), "--max-model-len", "100000"),
          too_long(100000))


def test_preload_says_it_takes_the_model_as_a_flag(main, tiny_model):
    check(*main("preload", str(tiny_model), "--device", "cpu"),
          ModelArgumentError.PRELOAD_POSITIONAL.format(positional=tiny_model))
    check(*main("preload", "--device", "cpu"), ModelArgumentError.PRELOAD_MISSING)
