"""The tokenizer files make-checkpoint writes beside the weights, as a downloaded model has them.

``tokenizer.json``: a byte-level BPE (GPT-2's and Llama 3's kind: every byte has an id, so any text
encodes) trained with Hugging Face ``tokenizers`` on tokenizer_corpus.TEXT, up to the preset's
vocabulary; ``<s>`` (BOS) and ``</s>`` (EOS) are its special tokens, ids 0 and 1, and encoding adds
BOS, as Llama's does. The trainer is deterministic: the same text and size give the same file on
every machine (tests/unit/test_checkpoint_tokenizer.py trains it in two processes).
``tokenizer_config.json`` names BOS and EOS and holds the chat template; ``generation_config.json``
gives the stop id, as transformers' ``save_pretrained`` writes it.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from wcache.core.tokenizer_corpus import TEXT

BOS_TEXT, EOS_TEXT = "<s>", "</s>"
BOS_ID, EOS_ID = 0, 1  # the trainer puts the special tokens first
# The byte alphabet and the two special tokens: the smallest vocabulary that encodes any text.
MIN_VOCAB_SIZE = 258

# The chat template of every preset: each message as `<|role|>`, a newline, its content and EOS;
# then, for a reply, `<|assistant|>` and a newline. BOS and EOS are written as text (the template
# sees them as bos_token and eos_token) and encoded as their ids (special tokens).
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + eos_token + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)


def train(vocab_size: int) -> Tokenizer:
    """A byte-level BPE of at most ``vocab_size`` ids (fewer when the corpus has no more merges)."""
    if vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(f"a byte-level tokenizer needs a vocabulary of at least {MIN_VOCAB_SIZE}, got {vocab_size}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[BOS_TEXT, EOS_TEXT], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), min_frequency=2)
    tok.train_from_iterator(TEXT.splitlines(), trainer=trainer)
    assert (tok.token_to_id(BOS_TEXT), tok.token_to_id(EOS_TEXT)) == (BOS_ID, EOS_ID)
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS_TEXT} $A", pair=f"{BOS_TEXT} $A {BOS_TEXT} $B",
                                                       special_tokens=[(BOS_TEXT, BOS_ID)])
    return tok


def tokenizer_config(model_max_length: int) -> dict:
    """tokenizer_config.json as transformers writes it (the legacy place of a single chat template)."""
    return {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS_TEXT, "eos_token": EOS_TEXT,
            "model_max_length": model_max_length, "chat_template": CHAT_TEMPLATE}


def write(out: Path, vocab_size: int, model_max_length: int) -> int:
    """Write the three files into ``out``; the number of ids the tokenizer has (up to ``vocab_size``)."""
    tok = train(vocab_size)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(model_max_length), indent=2) + "\n")
    generation = {"bos_token_id": BOS_ID, "eos_token_id": EOS_ID}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    return tok.get_vocab_size()
