"""A tiny Llama checkpoint that has learnt one sentence of the README, trained on CPU in seconds.

`make demo` serves it so its first answer is words, not the arbitrary tokens of the random presets:
greedy decoding of ``PROMPT`` gives the rest of ``SENTENCE``. The model is the Llama architecture
the engine serves (RMSNorm, rotary positions from wcache.model.rope, grouped-query attention, SwiGLU)
in float32, on the ids of make-checkpoint's tokenizer (a byte-level BPE, wcache.core.checkpoint_tokenizer,
at this model's vocabulary size); the checkpoint is written in the Hugging Face layout the engine
reads (names and shapes from wcache.core.checkpoint, and that tokenizer's files), so nothing about it
is special-cased.
Seeded and deterministic on one machine; on another the bytes may differ in the last bits, the
answer does not (training stops only once every next byte wins by a wide margin).

    python tools/sentence_model.py DIR
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from wcache.core import checkpoint_tokenizer
from wcache.core.checkpoint import Preset, hf_config, tensor_shapes
from wcache.model import rope

# README.md says this sentence (tests/integration/test_demo.py checks it does).
SENTENCE = "The weight cache keeps a model's weights in memory, so a restarted engine maps them instead of " \
           "reading the checkpoint again."
PROMPT = "The weight cache keeps"
SHAPE = Preset(hidden_size=64, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, vocab_size=320, max_position_embeddings=256, rope_theta=10000.0,
               max_shard_bytes=1 << 30)
MARGIN = 4.0  # logits: the right token must beat every other by this much at every position
MAX_STEPS = 600


def completion() -> str:
    """What the engine must answer to PROMPT: the rest of the sentence (then EOS stops it)."""
    return SENTENCE[len(PROMPT):]


def init(cfg: dict, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    w = {}
    for name, shape in tensor_shapes(cfg).items():
        if name.endswith("norm.weight"):
            w[name] = torch.ones(shape)
        else:
            w[name] = torch.randn(shape, generator=gen) * (0.02 if "embed" not in name else 0.5)
    return {n: t.requires_grad_() for n, t in w.items()}


def rms(x: torch.Tensor, g: torch.Tensor, eps: float) -> torch.Tensor:
    return g * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def forward(w: dict[str, torch.Tensor], cfg: dict, ids: torch.Tensor) -> torch.Tensor:
    """Logits for every position of ``ids`` (one sequence), as the engine's model computes them."""
    T, h = len(ids), cfg["hidden_size"]
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = h // heads
    cos, sin = rope.cos_sin(torch.arange(T), rope.Rope(theta=cfg["rope_theta"]), d, torch.float32)
    x = w["model.embed_tokens.weight"][ids]
    mask = torch.ones(T, T, dtype=torch.bool).tril()
    for n in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{n}."
        a = rms(x, w[p + "input_layernorm.weight"], cfg["rms_norm_eps"])
        q = rope.apply((a @ w[p + "self_attn.q_proj.weight"].T).view(T, heads, d), cos, sin)
        k = rope.apply((a @ w[p + "self_attn.k_proj.weight"].T).view(T, kv, d), cos, sin)
        v = (a @ w[p + "self_attn.v_proj.weight"].T).view(T, kv, d)
        k, v = k.repeat_interleave(heads // kv, 1), v.repeat_interleave(heads // kv, 1)
        o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask)
        x = x + o.transpose(0, 1).reshape(T, h) @ w[p + "self_attn.o_proj.weight"].T
        m = rms(x, w[p + "post_attention_layernorm.weight"], cfg["rms_norm_eps"])
        gate, up = m @ w[p + "mlp.gate_proj.weight"].T, m @ w[p + "mlp.up_proj.weight"].T
        x = x + (F.silu(gate) * up) @ w[p + "mlp.down_proj.weight"].T
    return rms(x, w["model.norm.weight"], cfg["rms_norm_eps"]) @ w["lm_head.weight"].T


def train(cfg: dict, seed: int = 0) -> tuple[dict[str, torch.Tensor], int]:
    """Weights that predict every next token of BOS + SENTENCE + EOS by MARGIN; and the steps taken."""
    torch.manual_seed(seed)
    torch.set_num_threads(1)  # a model this small: a second thread only contends (19 s against 5 s here)
    w = init(cfg, seed)
    tok = checkpoint_tokenizer.train(cfg["vocab_size"])
    sentence = tok.encode(SENTENCE).ids
    # The prompt's tokens begin the sentence's (it ends at a word boundary), so the engine's
    # encoding of PROMPT continues into the rest of the sentence.
    assert sentence[:len(tok.encode(PROMPT).ids)] == tok.encode(PROMPT).ids
    ids = torch.tensor([*sentence, checkpoint_tokenizer.EOS_ID])
    inputs, targets = ids[:-1], ids[1:]
    opt = torch.optim.Adam(w.values(), lr=1e-2)
    for step in range(1, MAX_STEPS + 1):
        logits = forward(w, cfg, inputs)
        loss = F.cross_entropy(logits, targets)
        opt.zero_grad()
        loss.backward()
        opt.step()
        with torch.no_grad():
            right = logits.gather(1, targets[:, None])[:, 0]
            others = logits.scatter(1, targets[:, None], float("-inf")).max(1).values
            if step % 25 == 0 and bool((right - others > MARGIN).all()):
                return {n: t.detach() for n, t in w.items()}, step
    raise RuntimeError(f"the sentence model did not learn its sentence in {MAX_STEPS} steps (loss {loss.item():.3f})")


def write(out_dir: str | Path, seed: int = 0) -> tuple[Path, int]:
    """Train and write config.json, model.safetensors and the tokenizer's files; returns the directory
    and the steps taken."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = hf_config(SHAPE, tie_embeddings=False, dtype="float32")
    weights, steps = train(cfg, seed)
    save_file({n: t.contiguous() for n, t in weights.items()}, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    checkpoint_tokenizer.write(out, SHAPE.vocab_size, SHAPE.max_position_embeddings)
    return out, steps


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        sys.exit(__doc__.strip().splitlines()[-1])
    t0 = time.perf_counter()
    out, steps = write(argv[0])
    print(f"trained {out} on {SENTENCE!r} in {steps} steps, {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
