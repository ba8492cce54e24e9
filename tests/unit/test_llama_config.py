"""config.json as transformers 4.x wrote it (before 4.56: torch_dtype, top-level rope_theta, rope_scaling)
reads as transformers 5 reads it; wcache's RoPE frequencies equal transformers' bit for bit.

The fixtures are published config.json files of well-known checkpoints, field for field as the 4.x
versions named in them wrote them (the parity test covers 4.57 and 5.x writing live)."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from wcache.core.llama_config import EXAMPLE, auto_dtype, normalize
from wcache.model import rope

# Llama-2-7b-hf, written by 4.31: no rope_theta, rope_scaling null, no head_dim, attention_bias or mlp_bias.
LLAMA2 = {
    "architectures": ["LlamaForCausalLM"], "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu",
    "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 11008, "max_position_embeddings": 4096,
    "model_type": "llama", "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 32,
    "pretraining_tp": 1, "rms_norm_eps": 1e-05, "rope_scaling": None, "tie_word_embeddings": False,
    "torch_dtype": "float16", "transformers_version": "4.31.0.dev0", "use_cache": True, "vocab_size": 32000,
}
# Llama-3.1-8B, written by 4.43: rope_theta beside a llama3 rope_scaling, eos a list.
LLAMA31 = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 128000, "eos_token_id": 128001, "hidden_act": "silu", "hidden_size": 4096,
    "initializer_range": 0.02, "intermediate_size": 14336, "max_position_embeddings": 131072, "mlp_bias": False,
    "model_type": "llama", "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
    "pretraining_tp": 1, "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.43.0.dev0", "use_cache": True, "vocab_size": 128256,
}
# Llama-3.2-1B, written by 4.45: tied embeddings, explicit head_dim, factor 32.
LLAMA32 = {
    **LLAMA31, "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16, "head_dim": 64,
    "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "tie_word_embeddings": True, "transformers_version": "4.45.0.dev0",
}
# A Llama 2 long-context fine-tune's legacy linear scaling, {"type": ...} (4.3x).
LINEAR_LEGACY = {**LLAMA2, "rope_scaling": {"type": "linear", "factor": 4.0}, "max_position_embeddings": 16384}
# transformers 5's own form.
TF5 = {**EXAMPLE, "head_dim": 32, "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                                       "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                       "original_max_position_embeddings": 64}}

CONFIGS = {"llama2": LLAMA2, "llama3.1": LLAMA31, "llama3.2": LLAMA32, "linear-legacy": LINEAR_LEGACY, "tf5": TF5}


def transformers_reads(raw: dict) -> LlamaConfig:
    return LlamaConfig(**{k: v for k, v in raw.items() if k not in ("architectures", "model_type", "transformers_version")})


@pytest.mark.parametrize("name", list(CONFIGS))
def test_fields_resolve_as_transformers_5_resolves_them(name):
    raw = CONFIGS[name]
    ours, theirs = normalize(raw, "config.json"), transformers_reads(raw)
    for key in ("head_dim", "num_key_value_heads", "rms_norm_eps", "max_position_embeddings", "tie_word_embeddings"):
        assert ours[key] == getattr(theirs, key), key
    theirs_rope = {k: v for k, v in theirs.rope_parameters.items() if k != "type"}
    assert ours["rope_parameters"] == theirs_rope
    assert normalize(raw, "config.json") is not raw and "rope_parameters" not in LLAMA2  # the input is left alone


@pytest.mark.parametrize("name", list(CONFIGS))
def test_rope_frequencies_equal_transformers_bit_for_bit(name):
    cfg, theirs = normalize(CONFIGS[name], "config.json"), transformers_reads(CONFIGS[name])
    kind = theirs.rope_parameters["rope_type"]
    expected = (ROPE_INIT_FUNCTIONS[kind](theirs, "cpu")[0] if kind != "default"
                else 1.0 / (theirs.rope_parameters["rope_theta"]
                            ** (torch.arange(0, cfg["head_dim"], 2, dtype=torch.float) / cfg["head_dim"])))
    ours = rope.inv_freq(rope.Rope.from_parameters(cfg["rope_parameters"]), cfg["head_dim"])
    assert torch.equal(ours, expected)
    if kind == "llama3":  # the scaling does something: long wavelengths slowed by the factor
        plain = rope.inv_freq(rope.Rope(theta=cfg["rope_parameters"]["rope_theta"]), cfg["head_dim"])
        assert not torch.equal(ours, plain) and ours[0] == plain[0]  # the shortest one is kept


def test_defaults_are_transformers_llama_defaults():
    minimal = {"model_type": "llama", "vocab_size": 300, "hidden_size": 64, "intermediate_size": 128,
               "num_hidden_layers": 1, "num_attention_heads": 4}
    cfg = normalize(minimal, "config.json")
    assert (cfg["rms_norm_eps"], cfg["max_position_embeddings"], cfg["tie_word_embeddings"]) == (1e-6, 2048, False)
    assert (cfg["num_key_value_heads"], cfg["head_dim"]) == (4, 16)
    assert cfg["rope_parameters"] == {"rope_type": "default", "rope_theta": 10000.0}
    # null is absent (transformers 5 writes "num_key_value_heads": null, "head_dim": null for derived ones)
    assert normalize({**minimal, "num_key_value_heads": None, "head_dim": None}, "c") == cfg


def test_dtype_field_of_either_major_and_the_stored_dtype_fallback():
    assert auto_dtype({"torch_dtype": "float16"}, "c", lambda: "bfloat16") == "float16"  # before 4.56
    assert auto_dtype({"dtype": "bfloat16", "torch_dtype": "float32"}, "c", lambda: None) == "bfloat16"  # 4.56+
    assert auto_dtype({}, "c", lambda: "bfloat16") == "bfloat16"  # none named: the weights' own, as transformers
    assert auto_dtype({"dtype": None}, "c", lambda: None) == "float32"
