"""A byte-level tokenizer: token ids 0..255 are bytes, then BOS and EOS. Nothing to download.

Decoding never hides a token: bytes that are not valid UTF-8 show as ``\\xNN`` (Python's
``backslashreplace``) instead of U+FFFD, characters that do not print (controls, a terminal's
escape sequences) show escaped too, and ids past the bytes that are not BOS or EOS (the rest of a
Llama-sized vocabulary, which this tokenizer gives no text) show as ``<id>``. So a completion of
random weights reads as the tokens it is.

A chat template writes BOS and EOS as text (``{{ bos_token }}``); ``encode_with_special_tokens``
reads those strings back as their ids, as a Hugging Face tokenizer does with its special tokens.
"""

import re

BOS_ID = 256
EOS_ID = 257
MIN_VOCAB_SIZE = 258
# The text of BOS and EOS in a rendered chat prompt (make-checkpoint writes them to
# tokenizer_config.json; a checkpoint's own bos_token / eos_token replace them).
BOS_TEXT = "<s>"
EOS_TEXT = "</s>"


def encode(text: str, add_bos: bool = True) -> list[int]:
    ids = list(text.encode("utf-8"))
    return [BOS_ID, *ids] if add_bos else ids


def decode(ids: list[int]) -> str:
    out, run = [], bytearray()
    for i in [*ids, None]:
        if i is not None and i < 256:
            run.append(i)
            continue
        text = run.decode("utf-8", errors="backslashreplace")
        out += [c if c.isprintable() or c in "\n\t" else c.encode("unicode_escape").decode("ascii") for c in text]
        run.clear()
        if i is not None and i not in (BOS_ID, EOS_ID):
            out.append(f"<{i}>")
    return "".join(out)


def encode_with_special_tokens(text: str, special: dict[str, int]) -> list[int]:
    """``text`` as bytes, except that each string of ``special`` (e.g. ``{"<s>": BOS_ID}``) is its one
    id; no BOS is added (a chat template writes its own). Longer strings win where two overlap."""
    names = sorted((s for s in special if s), key=len, reverse=True)
    if not names:
        return encode(text, add_bos=False)
    ids: list[int] = []
    for i, part in enumerate(re.split("(" + "|".join(map(re.escape, names)) + ")", text)):
        ids += [special[part]] if i % 2 else encode(part, add_bos=False)
    return ids
