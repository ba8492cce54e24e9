"""Write Llama and Qwen3 checkpoints with the transformers library itself, and its answers on them.

Run as ``python hf_reference.py SPEC.json``, under whichever transformers major is importable (the
venv's 5.x, or 4.x by putting a second install first on PYTHONPATH). SPEC is a list of
``{"name", "config", "dtype", "max_shard_size", "seed", "init_std", "text", "max_tokens",
"eos_id", "out"}``. For each entry it builds the model of ``config``'s ``model_type`` (default ``llama``:
``LlamaForCausalLM(LlamaConfig(**config))``; ``qwen3``: ``Qwen3ForCausalLM``) with seeded
random weights and a fast tokenizer (make-checkpoint's byte-level BPE, trained with ``tokenizers``,
wrapped in ``PreTrainedTokenizerFast`` with BOS, EOS and a chat template), saves both with
``save_pretrained(out/"model", ...)`` exactly as a user would, loads that directory back with
``from_pretrained`` (so the reference is what transformers computes from the files, not from
memory), and writes ``out/reference.json``: the prompt ids of ``text`` (AutoTokenizer's), and for
each of ``compute_dtypes`` (default float32) the logits of every prompt position (as float32) and
the greedy continuation (argmax, full recomputation each step, stopping after ``eos_id`` as
wcache's engine does) with its smallest winning margin. With ``"stop_early": true`` it then lists a
token of that continuation beside EOS in ``generation_config.json``'s ``eos_token_id`` and records
what ``generate`` answers (ids, and text decoded with special tokens skipped), which must stop
there; and the ids ``apply_chat_template`` gives for ``chat``. The reverse direction (a wcache
checkpoint read by transformers) passes ``"load": DIR`` instead of a config.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig, PreTrainedTokenizerFast

from wcache.core.checkpoint_tokenizer import BOS_TEXT, CHAT_TEMPLATE, EOS_TEXT, train

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def dtype_kwarg(dtype: torch.dtype) -> dict:
    # transformers 4.56 renamed from_pretrained's torch_dtype to dtype; 5.x only knows dtype.
    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    return {"dtype": dtype} if (major, minor) >= (4, 56) else {"torch_dtype": dtype}


def write(entry: dict) -> Path:
    out = Path(entry["out"])
    model_dir = out / "model"
    torch.manual_seed(entry.get("seed", 0))
    fields = dict(entry["config"])
    config = AutoConfig.for_model(fields.pop("model_type", "llama"), **fields)
    model = AutoModelForCausalLM.from_config(config)
    std = entry.get("init_std")
    if std:  # wider than transformers' initializer_range, so greedy choices are clear-cut
        with torch.no_grad():
            for name, p in model.named_parameters():
                if not name.endswith("norm.weight"):
                    p.normal_(0.0, std)
                else:
                    p.copy_(1.0 + 0.1 * torch.randn_like(p))
    model.to(DTYPES[entry["dtype"]]).save_pretrained(model_dir, max_shard_size=entry.get("max_shard_size", "5GB"))
    tok = PreTrainedTokenizerFast(tokenizer_object=train(config.vocab_size), bos_token=BOS_TEXT, eos_token=EOS_TEXT)
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(model_dir)
    return model_dir


def reference(model_dir: Path, entry: dict, dtype: torch.dtype) -> dict:
    extra = {}
    if entry.get("fp8_dequantize"):
        from transformers import FineGrainedFP8Config

        extra["quantization_config"] = FineGrainedFP8Config(dequantize=True)
    model = AutoModelForCausalLM.from_pretrained(model_dir, **dtype_kwarg(dtype), **extra).eval()
    ids = AutoTokenizer.from_pretrained(model_dir)(entry["text"])["input_ids"]
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
        greedy, seq, margins = [], list(ids), []
        for _ in range(entry["max_tokens"]):
            last = model(torch.tensor([seq])).logits[0, -1].float()
            top = last.topk(2).values
            margins.append(float(top[0] - top[1]))
            greedy.append(int(last.argmax()))
            seq.append(greedy[-1])
            if greedy[-1] == entry.get("eos_id"):
                break
    return {"prompt_ids": ids, "logits": logits.tolist(), "greedy": greedy, "min_margin": min(margins)}


def stop_early(model_dir: Path, entry: dict, greedy: list[int]) -> dict:
    """List a token the greedy continuation reaches (not its first few) as a second EOS in
    generation_config.json, and what ``generate`` answers then: it must stop at that token."""
    stop = next(t for k, t in enumerate(greedy) if k >= 3 and t not in greedy[:k])
    config = GenerationConfig.from_pretrained(model_dir)
    config.eos_token_id = [entry["eos_id"], stop]
    config.save_pretrained(model_dir)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, **dtype_kwarg(torch.float32)).eval()
    ids = tok(entry["text"])["input_ids"]
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=entry["max_tokens"], do_sample=False)[0, len(ids):].tolist()
    chat = tok.apply_chat_template(entry["chat"], add_generation_prompt=True, tokenize=True)
    chat = chat["input_ids"] if isinstance(chat, dict) or hasattr(chat, "keys") else chat
    # The text of the ids before the stop token: a real EOS is a special token, which
    # skip_special_tokens leaves out; the listed one here is not, and vLLM (so wcache) leaves a stop
    # token's text out of the answer.
    text = tok.decode(out[:-1] if out[-1] in config.eos_token_id else out, skip_special_tokens=True)
    return {"stop": stop, "ids": out, "text": text, "chat_ids": list(chat)}


def main(spec_path: str) -> int:
    for entry in json.loads(Path(spec_path).read_text()):
        model_dir = Path(entry["load"]) if "load" in entry else write(entry)
        Path(entry["out"]).mkdir(parents=True, exist_ok=True)
        by_dtype = {name: reference(model_dir, entry, DTYPES[name]) for name in entry.get("compute_dtypes", ["float32"])}
        generated = stop_early(model_dir, entry, by_dtype["float32"]["greedy"]) if entry.get("stop_early") else None
        (Path(entry["out"]) / "reference.json").write_text(
            json.dumps({"transformers": transformers.__version__, **by_dtype, "generate": generated}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
