"""Token ids for tests that drive the model directly (not through `wcache serve`, which encodes with
the checkpoint's own tokenizer.json): make-checkpoint's tokenizer at its smallest, the byte
alphabet and BOS/EOS (ids 0-257), so the ids fit every preset's and every test model's vocabulary."""

from __future__ import annotations

import functools

from wcache.core.checkpoint_tokenizer import BOS_ID, EOS_ID, MIN_VOCAB_SIZE, train  # noqa: F401 (BOS_ID: tests')


@functools.cache
def _tokenizer():
    return train(MIN_VOCAB_SIZE)


def encode(text: str) -> list[int]:
    """BOS, then the text's ids."""
    return _tokenizer().encode(text).ids


def decode(ids: list[int]) -> str:
    return _tokenizer().decode(ids)


@functools.cache
def _preset_tokenizer(vocab_size: int):
    return train(vocab_size)


def preset_encode(text: str, preset: str = "tiny") -> list[int]:
    """``text``'s ids as a make-checkpoint checkpoint of ``preset`` encodes it (its tokenizer.json)."""
    from wcache.core.checkpoint import PRESETS

    return _preset_tokenizer(PRESETS[preset].vocab_size).encode(text).ids
