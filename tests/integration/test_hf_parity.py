"""Parity with transformers' LlamaForCausalLM, the proof behind docs/configuration.md's list of
supported checkpoints.

Checkpoints are written by the transformers library itself (hf_reference.py, in a subprocess: the
venv's 5.x, and 4.x from a second install in .work/tf4 that `make dev` makes), weights and a fast
tokenizer with a chat template, and a generation_config.json whose eos_token_id lists EOS and a
token the greedy continuation reaches; it also records what transformers computes from the saved
files: the prompt's ids, the float32 logits of every prompt position, the greedy continuation, what
`generate` answers (ids and text, stopped at that listed token) and the ids `apply_chat_template`
gives. For each checkpoint a real `wcache preload` daemon and two real `wcache serve` engines (one
from disk, one with `--load-format ipc_cache` and fallback off) run; over HTTP, given the prompt as
text, both must return exactly `generate`'s token ids and text, stopping at the same token, and a
chat request must be encoded to `apply_chat_template`'s ids; the logits of an engine that maps the
daemon's weights (and of one that reads the disk) must be within TOLERANCE of transformers', in
float32. A bfloat16 checkpoint is also computed in bfloat16 (what --dtype auto picks) and compared
with transformers computing in bfloat16, to the looser bfloat16 tolerance.
Autotune is off here: its candidates agree with F.linear only to a tolerance, so a tie-close
greedy step could flip; docs/autotune.md covers them.

The reverse direction: a `wcache make-checkpoint` checkpoint loaded by transformers gives the same
logits and greedy tokens as wcache, so the presets are real Llamas.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from procs import _healthy, complete, http
from wcache.core.checkpoint import make_checkpoint
from wcache.core.config import EngineConfig
from wcache.core.disk import load_processed
import prompt_ids as tokenizer
from wcache.model.llama import bind_weights, build_meta_model, generate

HERE = Path(__file__).parent
ROOT = HERE.parents[1]
TF4 = ROOT / ".work" / "tf4"  # transformers 4.x, installed apart from the venv's 5.x by `make dev`
PROMPT = "Hello, world"
IDS = tokenizer.encode(PROMPT)  # direction wcache -> transformers only: the written cases' are their tokenizer's
MAX_TOKENS = 12
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Héllo, how are you?"}]
# Largest |wcache - transformers| over all logits, as a fraction of the largest |logit|. float32:
# fused q/k/v and gate/up matmuls sum in another order (measured about 1e-6). bfloat16: both round
# at the same points (RMSNorm, RoPE), yet a fused matmul rounds differently (measured about 7e-3).
TOLERANCE = {"float32": 1e-5, "bfloat16": 3e-2}
NO_TUNE = "--no-enable-autotune"

BASE = {"vocab_size": 320, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "max_position_embeddings": 256, "bos_token_id": tokenizer.BOS_ID,
        "eos_token_id": tokenizer.EOS_ID}
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 16}

CASES = {
    # transformers 5: GQA, head_dim 32 != 64 / 4, Llama 3 RoPE, sharded with an index.
    "tf5-gqa-head-dim-llama3-sharded": {
        "writer": 5, "dtype": "float32", "max_shard_size": "40KB",
        "config": {**BASE, "num_key_value_heads": 2, "head_dim": 32,
                   "rope_parameters": {**LLAMA3, "rope_theta": 500000.0}}},
    # transformers 5: tied embeddings, linear RoPE, no num_key_value_heads (MHA), one model.safetensors.
    "tf5-tied-linear-single-file": {
        "writer": 5, "dtype": "float32",
        "config": {**BASE, "tie_word_embeddings": True,
                   "rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}}},
    # transformers 5: bfloat16 weights and "dtype": "bfloat16" (--dtype auto picks bfloat16).
    "tf5-bfloat16": {
        "writer": 5, "dtype": "bfloat16", "compute_dtypes": ["float32", "bfloat16"],
        "config": {**BASE, "num_key_value_heads": 1}},
    # transformers 5: Qwen3ForCausalLM (per-head q/k RMSNorm, head_dim 32 given), tied embeddings, GQA.
    "tf5-qwen3-tied": {
        "writer": 5, "dtype": "float32",
        "config": {**BASE, "model_type": "qwen3", "num_key_value_heads": 2, "head_dim": 32,
                   "tie_word_embeddings": True, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}},
    # transformers 4.x: Qwen3ForCausalLM in bfloat16, sharded, untied, top-level rope_theta.
    "tf4-qwen3-bfloat16-sharded": {
        "writer": 4, "dtype": "bfloat16", "compute_dtypes": ["float32", "bfloat16"], "max_shard_size": "40KB",
        "config": {**BASE, "model_type": "qwen3", "num_key_value_heads": 1, "head_dim": 16, "rope_theta": 1e6}},
    # transformers 5: Qwen2ForCausalLM (q, k and v biases), GQA, sharded.
    "tf5-qwen2-sharded": {
        "writer": 5, "dtype": "float32", "max_shard_size": "40KB",
        "config": {**BASE, "model_type": "qwen2", "num_key_value_heads": 2,
                   "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}},
    # transformers 4.x: top-level rope_theta, rope_scaling llama3, GQA, sharded.
    "tf4-gqa-llama3-sharded": {
        "writer": 4, "dtype": "float32", "max_shard_size": "40KB",
        "config": {**BASE, "num_key_value_heads": 2, "rope_theta": 500000.0, "rope_scaling": dict(LLAMA3)}},
    # transformers 4.x: the legacy rope_scaling {"type": "linear"} of Llama 2 long-context models.
    # Config parsing only, so checked in this process (no served copies: they add time, not proof).
    "tf4-linear-legacy-type": {
        "writer": 4, "dtype": "float32", "served": False,
        "config": {**BASE, "rope_scaling": {"type": "linear", "factor": 4.0}}},
}


def tf4_missing() -> str | None:
    if not (TF4 / "transformers").is_dir():
        return f"transformers 4.x is not installed in {TF4} (`make dev` installs it there)"
    return None


def start_writer(spec: list[dict], tmp: Path, major: int) -> subprocess.Popen:
    spec_file = tmp / f"spec-{major}.json"
    spec_file.write_text(json.dumps(spec))
    env = dict(os.environ)
    if major == 4:  # the second install first on the path: its transformers and huggingface_hub win
        env["PYTHONPATH"] = os.pathsep.join([str(TF4), env.get("PYTHONPATH", "")])
    return subprocess.Popen([sys.executable, str(HERE / "hf_reference.py"), str(spec_file)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> dict[str, Path]:
    """Every case's directory (model/ and reference.json), written by transformers."""
    tmp = tmp_path_factory.mktemp("hf")
    common = {"seed": 0, "init_std": 0.2, "text": PROMPT, "max_tokens": MAX_TOKENS, "eos_id": tokenizer.EOS_ID,
              "chat": CHAT}
    by_major: dict[int, list[dict]] = {4: [], 5: []}
    for name, case in CASES.items():
        entry = {**common, **{k: v for k, v in case.items() if k not in ("writer", "served")}, "name": name,
                 "out": str(tmp / name), "stop_early": case.get("served", True)}
        by_major[case["writer"]].append(entry)
    # The reverse direction: wcache's presets, read by transformers 5 in float32.
    for name, preset, tie in (("wcache-tiny", "tiny", False), ("wcache-tiny-tied", "tiny", True),
                              ("wcache-qwen3-tiny", "qwen3-tiny", False), ("wcache-qwen2-tiny", "qwen2-tiny", False)):
        model = make_checkpoint(tmp / name / "model", preset, tie_embeddings=tie)
        by_major[5].append({**common, "load": str(model), "out": str(tmp / name)})
    writers = [start_writer(by_major[5], tmp, 5)] + ([] if tf4_missing() else [start_writer(by_major[4], tmp, 4)])
    for w in writers:  # side by side: each spends seconds importing its transformers
        out, _ = w.communicate(timeout=300)
        assert w.returncode == 0, out
    return {p.name: p for p in tmp.iterdir() if p.is_dir()}


SERVED = [n for n, case in CASES.items() if case.get("served", True) and not (case["writer"] == 4 and tf4_missing())]


@pytest.fixture(scope="module")
def served(written, module_procs, module_env) -> dict[str, tuple]:
    """name -> (daemon, disk engine, cache engine, socket dir), all in float32 (the dtype of the
    comparison). Every daemon and disk engine starts at once, then every cache engine: the processes
    spend much of their start waiting, so side by side the whole set is ready in about the time of
    a few. Each daemon has a socket directory of its own (one daemon per device and directory)."""
    flags, engine_flags = (NO_TUNE, "--dtype", "float32"), ("--max-model-len", "64")
    sockets = {name: f"{module_env['TMPDIR']}/s{i}" for i, name in enumerate(SERVED)}
    started = {}
    for name in SERVED:
        model = written[name] / "model"
        started[name] = (module_procs.preload(model, *flags, "--weight-cache-socket-dir", sockets[name], ready=False,
                                              name=f"daemon-{name}"),
                         module_procs.serve(model, *flags, *engine_flags, ready=False, name=f"disk-{name}"))
    for daemon, disk in started.values():
        daemon.wait_for_log("Weight cache daemon READY")
        disk.wait_for(lambda p=disk.port: _healthy(p), what="/health 200")
    cached = {name: module_procs.serve(written[name] / "model", *flags, *engine_flags, "--load-format", "ipc_cache",
                                       "--model-loader-extra-config", json.dumps(loader(sockets[name])),
                                       ready=False, name=f"cache-{name}") for name in SERVED}
    for c in cached.values():
        c.wait_for(lambda p=c.port: _healthy(p), what="/health 200")
    yield {name: (*started[name], cached[name], sockets[name]) for name in SERVED}
    everything = [p for name in SERVED for p in (cached[name], *started[name])]
    for p in everything:  # all at once: stopping them one by one waits for each exit in turn
        p.proc.send_signal(signal.SIGTERM)
    for p in everything:
        p.stop()


def loader(socket_dir: str | None) -> dict:
    """The ipc_cache loader's settings: this daemon's sockets, and no silent disk fallback."""
    return {"fallback": False, **({"socket_dir": socket_dir} if socket_dir else {})}


def reference(case_dir: Path, dtype: str = "float32") -> dict:
    return json.loads((case_dir / "reference.json").read_text())[dtype]


def written_by(case_dir: Path) -> str:
    return json.loads((case_dir / "reference.json").read_text())["transformers"]


def engine_logits(model_dir: Path, load_format: str, dtype: str = "auto",
                  socket_dir: str | None = None, ids: list[int] = IDS) -> tuple[torch.Tensor, str]:
    """Every prompt position's logits from wcache's model bound to the weights of an engine's loader
    (in this process), and where they came from; ipc_cache with fallback off maps the running
    daemon's weights."""
    from wcache.engine.loading.config import parse_loader_config
    from wcache.engine.loading.registry import load_weights

    cfg = EngineConfig.build(str(model_dir), dtype, None, "cpu")
    loaded = load_weights(cfg, load_format, parse_loader_config(loader(socket_dir)))
    try:
        model = bind_weights(build_meta_model(cfg.shape, cfg.quant, cfg.dtype), loaded.weights.bindable())
        logits = model(torch.tensor(ids), 0, model.new_cache(len(ids)), all_positions=True)
        return logits.float(), loaded.report.source
    finally:
        loaded.close()


def assert_close(actual: torch.Tensor, expected: torch.Tensor, tol: float) -> None:
    err = (actual.double() - expected.double()).abs().max().item()
    scale = expected.abs().max().item()
    assert err <= tol * scale, f"max |wcache - transformers| {err:.3g} exceeds {tol:g} x max |logit| {scale:.3g}"


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n, case in CASES.items() if case.get("served", True)])
def test_served_from_disk_and_from_the_cache_like_transformers(name, written, served):
    if name not in SERVED:
        pytest.skip(tf4_missing())
    case_dir = written[name]
    ref, model = reference(case_dir), case_dir / "model"
    stored = CASES[name]["dtype"]
    assert EngineConfig.build(str(model), "auto", None, "cpu").dtype_name == stored  # the dtype field is read
    dtype = "float32"
    # Each of transformers' greedy steps wins by more than twice the logit tolerance, so a wcache
    # within tolerance must choose the same tokens, and one that is not is caught.
    scale = max(abs(x) for row in ref["logits"] for x in row)
    assert ref["min_margin"] > 2 * TOLERANCE[dtype] * scale, (ref["min_margin"], scale)

    daemon, disk, cached, socket_dir = served[name]
    assert "from disk" in disk.log() and "Mapped " in cached.log(), cached.log()
    generated = json.loads((case_dir / "reference.json").read_text())["generate"]
    assert generated["ids"][-1] == generated["stop"] and len(generated["ids"]) < MAX_TOKENS  # it stopped there
    assert generated["ids"] == ref["greedy"][:len(generated["ids"])]
    for engine in (disk, cached):
        body = complete(engine.port, PROMPT, MAX_TOKENS)
        choice = body["choices"][0]
        assert choice["token_ids"] == generated["ids"], (engine.args, written_by(case_dir))
        assert (choice["text"], choice["finish_reason"]) == (generated["text"], "stop")
        assert body["usage"]["prompt_tokens"] == len(ref["prompt_ids"])
    status, chat = http("POST", f"http://127.0.0.1:{cached.port}/v1/chat/completions",
                        {"messages": CHAT, "max_tokens": 1})
    assert status == 200 and chat["usage"]["prompt_tokens"] == len(generated["chat_ids"]), chat
    for load_format in ("ipc_cache", "safetensors"):
        logits, source = engine_logits(model, load_format, dtype, socket_dir, ref["prompt_ids"])
        assert ("weight cache" in source) == (load_format == "ipc_cache"), source
        assert_close(logits, torch.tensor(ref["logits"]), TOLERANCE[dtype])
    assert daemon.proc.poll() is None
    if stored == "bfloat16":  # in the checkpoint's own dtype, as --dtype auto serves it
        logits, _ = engine_logits(model, "safetensors", "auto", ids=ref["prompt_ids"])
        assert_close(logits, torch.tensor(reference(case_dir, "bfloat16")["logits"]), TOLERANCE["bfloat16"])


@pytest.mark.parametrize("name", ["wcache-tiny", "wcache-tiny-tied", "wcache-qwen3-tiny", "wcache-qwen2-tiny",
                                  "tf4-linear-legacy-type"])
def test_computed_like_transformers_in_this_process(name, written):
    """wcache's presets read by transformers (the reverse direction), and the cases not served."""
    if name.startswith("tf4") and tf4_missing():
        pytest.skip(tf4_missing())
    ref = reference(written[name])
    logits, _ = engine_logits(written[name] / "model", "safetensors", dtype="float32", ids=ref["prompt_ids"])
    assert_close(logits, torch.tensor(ref["logits"]), TOLERANCE["float32"])
    scale = max(abs(x) for row in ref["logits"] for x in row)
    assert ref["min_margin"] > 2 * TOLERANCE["float32"] * scale, (ref["min_margin"], scale)
    cfg = EngineConfig.build(str(written[name] / "model"), "float32", None, "cpu")
    model = bind_weights(build_meta_model(cfg.shape, cfg.quant, cfg.dtype), load_processed(cfg, False).bindable())
    assert generate(model, ref["prompt_ids"], MAX_TOKENS, eos_id=tokenizer.EOS_ID) == ref["greedy"]


@pytest.mark.parametrize("name", ["tf5-gqa-head-dim-llama3-sharded", "tf4-gqa-llama3-sharded"])
def test_a_chat_request_is_encoded_as_apply_chat_template_encodes_it(name, written):
    """The served chat path's own parser (engine/openai/chat.py), on transformers' saved tokenizer and
    template: the prompt ids are apply_chat_template's."""
    if name.startswith("tf4") and tf4_missing():
        pytest.skip(tf4_missing())
    from wcache.engine.openai import chat, chat_template
    from wcache.model.tokenizer import Tokenizer

    model = str(written[name] / "model")
    want = json.loads((written[name] / "reference.json").read_text())["generate"]["chat_ids"]
    req = chat.parse_chat_request(json.dumps({"messages": CHAT}).encode(), chat_template.load(model), 256,
                                  tokenizer=Tokenizer.load(model))
    assert req.prompt == want


def test_transformers_4_writes_what_the_4x_cases_claim(written):
    """The 4.x checkpoints really come from 4.x and keep its field names (not 5.x's)."""
    if tf4_missing():
        pytest.skip(tf4_missing())
    assert written_by(written["tf4-gqa-llama3-sharded"]).startswith("4.")
    cfg = json.loads((written["tf4-gqa-llama3-sharded"] / "model" / "config.json").read_text())
    assert cfg["rope_theta"] == 500000.0 and cfg["rope_scaling"]["rope_type"] == "llama3"
    assert "rope_parameters" not in cfg
    assert (written["tf4-gqa-llama3-sharded"] / "model" / "model.safetensors.index.json").is_file()
    cfg5 = json.loads((written["tf5-gqa-head-dim-llama3-sharded"] / "model" / "config.json").read_text())
    assert cfg5["rope_parameters"]["rope_theta"] == 500000.0 and "rope_theta" not in cfg5
    assert written_by(written["tf5-bfloat16"]).startswith("5.")


def test_the_guide_states_these_tolerances():
    """docs/configuration.md quotes TOLERANCE; a change here must change the page."""
    def short(x: float) -> str:  # 1e-05 -> 1e-5, as the page writes it
        mantissa, exponent = f"{x:.0e}".split("e")
        return f"{mantissa}e{int(exponent)}"

    text = " ".join((ROOT / "docs" / "configuration.md").read_text(encoding="utf-8").split())
    assert f"within {short(TOLERANCE['float32'])} of the largest logit in float32" in text
    assert f"within {short(TOLERANCE['bfloat16'])} in bfloat16" in text
    assert "tests/integration/test_hf_parity.py" in text
