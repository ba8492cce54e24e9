"""A byte-level tokenizer: token ids 0..255 are bytes, then BOS and EOS. Nothing to download.

Decoding never hides a token: bytes that are not valid UTF-8 show as ``\\xNN`` (Python's
``backslashreplace``) instead of U+FFFD, characters that do not print (controls, a terminal's
escape sequences) show escaped too, and ids past the bytes that are not BOS or EOS (the rest of a
Llama-sized vocabulary, which this tokenizer gives no text) show as ``<id>``. So a completion of
random weights reads as the tokens it is.
"""

BOS_ID = 256
EOS_ID = 257
MIN_VOCAB_SIZE = 258


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
