"""Checkpoints: deterministic bytes, the Hugging Face layout, shards + index, preset shapes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors import safe_open
from wcache import cli
from wcache.core.checkpoint import (
    PRESETS,
    hf_config,
    make_checkpoint,
    tensor_shapes,
)
from wcache.core.checkpoint_files import read_config, shard_files

TINY_FILES = {"config.json", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
              "model.safetensors.index.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json"}


def _contents(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


def _tensors(d: Path) -> dict[str, tuple[tuple[int, ...], str, str]]:
    """name -> (shape, dtype, file) over every shard."""
    out = {}
    for f in shard_files(d):
        with safe_open(str(f), framework="pt") as s:
            for name in s.keys():  # noqa: SIM118 - safe_open is not a mapping
                t = s.get_slice(name)
                out[name] = (tuple(t.get_shape()), t.get_dtype(), f.name)
    return out


def test_same_seed_gives_identical_bytes(tmp_path, tiny_model):
    again = make_checkpoint(tmp_path / "again", "tiny")
    assert _contents(again) == _contents(tiny_model)


def test_different_seed_changes_every_shard(tmp_path, tiny_model):
    other = make_checkpoint(tmp_path / "seed1", "tiny", seed=1)
    a, b = _contents(tiny_model), _contents(other)
    assert a.keys() == b.keys() == TINY_FILES
    assert a["config.json"] == b["config.json"]
    for name in a:
        if name.endswith(".safetensors"):
            assert a[name] != b[name], f"{name} did not change with the seed"


def test_tiny_has_two_shards_and_an_index_covering_every_tensor(tiny_model):
    assert {p.name for p in tiny_model.iterdir()} == TINY_FILES
    index = json.loads((tiny_model / "model.safetensors.index.json").read_text())
    found = _tensors(tiny_model)
    assert index["weight_map"] == {name: f for name, (_, _, f) in found.items()}
    assert set(index["weight_map"].values()) == {"model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"}
    assert index["metadata"]["total_size"] == sum(2 * _numel(s) for s, _, _ in found.values())
    total = sum(p.stat().st_size for p in tiny_model.iterdir())
    assert total < 10 << 20, f"tiny is {total} bytes; it should be a few MB"


def test_hf_names_shapes_and_config(tiny_model):
    cfg = read_config(tiny_model)
    p = PRESETS["tiny"]
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["model_type"] == "llama"
    assert (cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"],
            cfg["num_key_value_heads"], cfg["vocab_size"]) == (p.hidden_size, p.intermediate_size,
                                                               p.num_hidden_layers, p.num_attention_heads,
                                                               p.num_key_value_heads, p.vocab_size)
    assert cfg["tie_word_embeddings"] is False and cfg["torch_dtype"] == "bfloat16"
    found = _tensors(tiny_model)
    h, i, v, kv = 128, 384, 512, 2 * (128 // 4)
    expected = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,), "lm_head.weight": (v, h)}
    for n in range(4):
        pre = f"model.layers.{n}."
        expected.update({
            pre + "input_layernorm.weight": (h,), pre + "post_attention_layernorm.weight": (h,),
            pre + "self_attn.q_proj.weight": (h, h), pre + "self_attn.k_proj.weight": (kv, h),
            pre + "self_attn.v_proj.weight": (kv, h), pre + "self_attn.o_proj.weight": (h, h),
            pre + "mlp.gate_proj.weight": (i, h), pre + "mlp.up_proj.weight": (i, h),
            pre + "mlp.down_proj.weight": (h, i),
        })
    assert {n: s for n, (s, _, _) in found.items()} == expected
    assert {d for _, d, _ in found.values()} == {"BF16"}


def test_tie_embeddings_drops_lm_head(tmp_path, capsys):
    out = tmp_path / "tied"
    assert cli.main(["make-checkpoint", str(out), "--preset", "tiny", "--tie-embeddings"]) == 0
    assert f"Wrote tiny checkpoint to {out}" in capsys.readouterr().out
    found = _tensors(out)
    assert "lm_head.weight" not in found and "model.embed_tokens.weight" in found
    assert len(found) == 2 + 4 * 9
    assert read_config(out)["tie_word_embeddings"] is True


def test_llama_8b_preset_has_the_shapes_of_llama_3_1_8b():
    shapes = tensor_shapes(hf_config(PRESETS["llama-8b"], False, "bfloat16"))
    assert len(shapes) == 291
    assert shapes["model.embed_tokens.weight"] == (128256, 4096) == shapes["lm_head.weight"]
    assert shapes["model.layers.31.self_attn.k_proj.weight"] == (1024, 4096)
    assert shapes["model.layers.0.mlp.gate_proj.weight"] == (14336, 4096)
    assert shapes["model.layers.0.mlp.down_proj.weight"] == (4096, 14336)
    params = sum(_numel(s) for s in shapes.values())
    assert params == 8_030_261_248  # Llama-3.1-8B's parameter count
    assert 15.9e9 < 2 * params < 16.2e9  # about 16 GB in bf16
    assert len(tensor_shapes(hf_config(PRESETS["llama-8b"], True, "bfloat16"))) == 290


def test_small_preset_is_about_500_mb():
    nbytes = 2 * sum(_numel(s) for s in tensor_shapes(hf_config(PRESETS["small"], False, "bfloat16")).values())
    assert 400e6 < nbytes < 600e6


def test_unknown_preset_and_missing_config_are_clear_errors(tmp_path):
    with pytest.raises(ValueError, match=r"Unknown preset 'huge'; choose one of \["):
        make_checkpoint(tmp_path / "x", "huge")
    from wcache.core.checkpoint_files import CheckpointError

    with pytest.raises(CheckpointError, match="No config.json in .*: not a model directory"):
        read_config(tmp_path)
    # A mistyped path says so, not that the directory lacks a config.json ("No config.json in tinyy").
    with pytest.raises(CheckpointError, match="^Model directory .*/tinyy: no such directory$"):
        read_config(tmp_path / "tinyy")
    (tmp_path / "file").write_text("")
    with pytest.raises(CheckpointError, match="^Model directory .*/file: not a directory$"):
        read_config(tmp_path / "file")


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
