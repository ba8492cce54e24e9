"""config.json as transformers' LlamaConfig reads it, or a refusal that names the field.

The transformers library writes Llama checkpoints differently in its current major (5.x) and the
previous one (4.x): the dtype is ``dtype`` (4.56 and later) or ``torch_dtype`` (earlier); RoPE is
``rope_parameters`` with ``rope_theta`` inside (5.x) or a top-level ``rope_theta`` beside a
``rope_scaling`` dict whose type key is ``rope_type`` or, in older files, ``type`` (4.x); ``head_dim``
and ``num_key_value_heads`` may be absent (derived) or null. `normalize` resolves all of that the
way transformers 5 does (its defaults included: ``rms_norm_eps`` 1e-6, ``max_position_embeddings``
2048, no tied embeddings) and adds the result under the 5.x names, so that the model reads one
form. Whatever the engine does not compute exactly like ``LlamaForCausalLM`` (another
architecture, biases, a sliding window, a RoPE type it lacks, another activation) raises
`UnsupportedCheckpointError`: one line, exit 2, instead of different logits.
"""

from __future__ import annotations

import json

from wcache.errors import UnsupportedCheckpointError

ARCHITECTURE = "LlamaForCausalLM"
# model_type -> the one architecture of it served. Qwen3 is Llama's layers with an RMSNorm of each
# query and key head before RoPE (q_norm, k_norm), and head_dim 128 unless config.json says; Qwen2
# is Llama's layers with biases on the q, k and v projections (always: its config has no field).
ARCHITECTURES = {"llama": ARCHITECTURE, "qwen3": "Qwen3ForCausalLM", "qwen2": "Qwen2ForCausalLM"}
QWEN3_HEAD_DIM = 128
ROPE_TYPES = ("default", "linear", "llama3")
LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor")
# transformers' ACT2FN maps both names to SiLU.
ACTIVATIONS = ("silu", "swish")
DTYPES = ("bfloat16", "float16", "float32")
REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
# LlamaConfig's defaults for fields a config.json may leave out.
DEFAULTS = {"rms_norm_eps": 1e-6, "max_position_embeddings": 2048, "tie_word_embeddings": False,
            "rope_theta": 10000.0}


def show(value) -> str:
    """A value as config.json spells it (true, "gelu", ["MistralForCausalLM"])."""
    return json.dumps(value)


def _positive_int(cfg: dict, key: str, path) -> int:
    value = cfg.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise UnsupportedCheckpointError(path, key, "missing" if value is None else show(value), "required")
    return value


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def rope_parameters(cfg: dict, path) -> dict:
    """The flat 5.x ``rope_parameters`` dict: rope_type, rope_theta and the type's own keys.

    As in transformers 5: a non-empty ``rope_scaling`` (4.x) wins over ``rope_parameters``; a
    ``rope_theta`` inside the dict wins over the top-level one; the type key may be ``type``; llama3's
    ``original_max_position_embeddings`` comes from the top level when set there, else from the dict,
    else it is ``max_position_embeddings``."""
    where = "rope_scaling" if cfg.get("rope_scaling") else "rope_parameters"
    raw = cfg.get(where) or {}
    if not isinstance(raw, dict) or any(isinstance(v, dict) for v in raw.values()):
        raise UnsupportedCheckpointError(path, where, show(raw), "rope_nested")
    rope = dict(raw)
    type_key = "rope_type" if "rope_type" in rope else "type"
    rope_type = rope.pop("type", None) if type_key == "type" else rope["rope_type"]
    rope["rope_type"] = rope_type = rope_type or "default"
    if rope_type not in ROPE_TYPES:
        raise UnsupportedCheckpointError(path, f"{where}.{type_key}", show(rope_type), "rope_type")
    rope.setdefault("rope_theta", cfg.get("rope_theta", DEFAULTS["rope_theta"]))
    partial = rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor"))
    if partial is not None and partial != 1:
        field = f"{where}.partial_rotary_factor" if "partial_rotary_factor" in rope else "partial_rotary_factor"
        raise UnsupportedCheckpointError(path, field, show(partial), "partial_rotary_factor")
    needs = {"default": (), "linear": ("factor",), "llama3": LLAMA3_KEYS}[rope_type]
    for key in ("rope_theta", *needs):
        if not _number(rope.get(key)) or rope[key] <= 0:
            raise UnsupportedCheckpointError(path, f"{where}.{key}", show(rope.get(key)) if key in rope else "missing",
                                             "rope_field", rope_type=rope_type, needs=_needs(rope_type))
    if rope_type == "llama3":
        if "original_max_position_embeddings" in cfg:
            rope["original_max_position_embeddings"] = cfg["original_max_position_embeddings"]
        rope.setdefault("original_max_position_embeddings", cfg["max_position_embeddings"])
        if not _number(rope["original_max_position_embeddings"]) or rope["original_max_position_embeddings"] <= 0:
            raise UnsupportedCheckpointError(path, f"{where}.original_max_position_embeddings",
                                             show(rope["original_max_position_embeddings"]), "rope_field",
                                             rope_type=rope_type, needs=_needs(rope_type))
        if rope["high_freq_factor"] <= rope["low_freq_factor"]:
            raise UnsupportedCheckpointError(path, f"{where}.high_freq_factor", show(rope["high_freq_factor"]),
                                             "rope_field", rope_type=rope_type, needs=_needs(rope_type))
    return rope


def _needs(rope_type: str) -> str:
    if rope_type == "llama3":
        return "positive factor, low_freq_factor and high_freq_factor, with high_freq_factor > low_freq_factor"
    return "a positive rope_theta" + (" and factor" if rope_type == "linear" else "")


def auto_dtype(cfg: dict, path, stored) -> str:
    """What ``--dtype auto`` computes in, as transformers' ``dtype="auto"``: config.json's ``dtype``
    (4.56 and later) or ``torch_dtype`` (earlier), else ``stored()``, the weights' own dtype."""
    field = "dtype" if cfg.get("dtype") is not None else "torch_dtype"
    name = cfg.get(field)
    if name is None:
        field, name = "dtype", stored() or "float32"
    if name not in DTYPES:
        raise UnsupportedCheckpointError(path, field, show(name), "dtype")
    return name


def normalize(raw: dict, path) -> dict:
    """The config with every field the engine reads resolved under its 5.x name, or a refusal."""
    if raw.get("model_type") not in ARCHITECTURES:
        raise UnsupportedCheckpointError(path, "model_type", show(raw.get("model_type")), "model_type")
    archs = raw.get("architectures")
    if archs is not None and archs != [ARCHITECTURES[raw["model_type"]]]:
        raise UnsupportedCheckpointError(path, "architectures", show(archs), "architectures")
    for key in REQUIRED:
        _positive_int(raw, key, path)
    for key in ("attention_bias", "mlp_bias"):
        if raw.get(key):
            raise UnsupportedCheckpointError(path, key, show(raw[key]), key)
    if raw.get("sliding_window") is not None and raw.get("use_sliding_window") is not False:
        raise UnsupportedCheckpointError(path, "sliding_window", show(raw["sliding_window"]), "sliding_window")
    if raw.get("hidden_act", "silu") not in ACTIVATIONS:
        raise UnsupportedCheckpointError(path, "hidden_act", show(raw["hidden_act"]), "hidden_act")
    cfg = dict(raw)
    for key, default in DEFAULTS.items():
        if key != "rope_theta" and cfg.get(key) is None:
            cfg[key] = default
    heads = raw["num_attention_heads"]
    if cfg.get("num_key_value_heads") is None:
        cfg["num_key_value_heads"] = heads
    if _positive_int(cfg, "num_key_value_heads", path) and heads % cfg["num_key_value_heads"]:
        raise UnsupportedCheckpointError(path, "num_key_value_heads", show(cfg["num_key_value_heads"]),
                                         "num_key_value_heads")
    if cfg.get("head_dim") is None:
        cfg["head_dim"] = QWEN3_HEAD_DIM if raw["model_type"] == "qwen3" else raw["hidden_size"] // heads
    cfg["qk_norm"] = raw["model_type"] == "qwen3"
    cfg["qkv_bias"] = raw["model_type"] == "qwen2"
    if _positive_int(cfg, "head_dim", path) % 2:
        raise UnsupportedCheckpointError(path, "head_dim", show(cfg["head_dim"]), "head_dim")
    _positive_int(cfg, "max_position_embeddings", path)
    cfg["rope_parameters"] = rope_parameters(cfg, path)
    return cfg


# Everything refused, each with one change to a valid config.json that shows it: the guide's table
# (tools/doc_tables.py runs `refusal` on each) and tests/integration/test_checkpoint_refusals.py.
REFUSED = {
    "architectures": ("anything but `[\"LlamaForCausalLM\"]` (for `qwen3` and `qwen2`, their own)",
                      {"architectures": ["MistralForCausalLM"]}),
    "model_type": ("anything but `\"llama\"`, `\"qwen3\"` or `\"qwen2\"`", {"model_type": "mistral"}),
    "attention_bias": ("`true`", {"attention_bias": True}),
    "mlp_bias": ("`true`", {"mlp_bias": True}),
    "sliding_window": ("set (not `null`), unless `use_sliding_window` is `false`", {"sliding_window": 4096}),
    "hidden_act": ("anything but `\"silu\"` (or `\"swish\"`)", {"hidden_act": "gelu"}),
    "rope_parameters.rope_type": ("`dynamic`, `yarn`, `longrope` or any other unknown type",
                                  {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0}}),
    "rope_scaling.type": ("the same, in 4.x's `rope_scaling` (`rope_type`, or the legacy `type`)",
                          {"rope_scaling": {"type": "dynamic", "factor": 2.0}}),
    "rope_parameters.low_freq_factor": ("missing or not positive for `llama3` (likewise `factor` for `linear`)",
                                        {"rope_parameters": {"rope_type": "llama3", "factor": 8.0,
                                                             "high_freq_factor": 4.0, "rope_theta": 500000.0}}),
    "partial_rotary_factor": ("anything but 1", {"partial_rotary_factor": 0.5}),
    "dtype": ("`float64` or another dtype, with `--dtype auto`", {"dtype": "float64"}),
    "torch_dtype": ("the same, in the field before 4.56", {"dtype": None, "torch_dtype": "float64"}),
    "head_dim": ("odd", {"head_dim": 33}),
    "num_key_value_heads": ("not a divisor of `num_attention_heads`", {"num_key_value_heads": 3}),
    "hidden_size": ("missing or not a positive integer (likewise the other sizes)", {"hidden_size": None}),
}
# The valid config.json the examples change (transformers 5's own fields for a small Llama).
EXAMPLE = {"architectures": [ARCHITECTURE], "model_type": "llama", "vocab_size": 320, "hidden_size": 64,
           "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
           "hidden_act": "silu", "dtype": "float32", "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}


def example(field: str) -> dict:
    """EXAMPLE with REFUSED[field]'s change (a None value removes the key)."""
    cfg = {**EXAMPLE, **REFUSED[field][1]}
    return {k: v for k, v in cfg.items() if v is not None}


def refusal(cfg: dict, path) -> str | None:
    """The refusal's message for this config.json, or None when it is served (with --dtype auto)."""
    try:
        auto_dtype(normalize(cfg, path), path, lambda: None)
    except UnsupportedCheckpointError as e:
        return str(e)
    return None
