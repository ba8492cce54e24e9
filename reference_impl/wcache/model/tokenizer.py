"""A byte-level tokenizer: token ids 0..255 are bytes, then BOS and EOS. Nothing to download."""

BOS_ID = 256
EOS_ID = 257
MIN_VOCAB_SIZE = 258


def encode(text: str, add_bos: bool = True) -> list[int]:
    ids = list(text.encode("utf-8"))
    return [BOS_ID, *ids] if add_bos else ids


def decode(ids: list[int]) -> str:
    # Ids past the byte range (BOS, EOS, padding rows of the vocabulary) carry no text.
    return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")
