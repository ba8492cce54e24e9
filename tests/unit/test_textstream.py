"""A completion's text as tokens arrive (engine/core/textstream.py over model/tokenizer.py's incremental
Detokenizer) and how tokens are drawn (engine/worker/sampling.py): the pieces never split a character nor
repeat a token, always join to the decoding of every id, stop strings cut the text, a stop id adds
none; sampling is greedy at temperature 0 and reproducible with a seed."""

from __future__ import annotations

import pytest
import torch
from wcache.core.checkpoint_tokenizer import BOS_ID, EOS_ID, train
from wcache.engine.worker.sampling import Sampler, SamplingParams
from wcache.engine.core.textstream import TextStream
from wcache.model.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer(train(512), "test", "<s>", "</s>")


def run(tok, ids: list[int], stop=(), skip=True, stop_ids=()) -> tuple[list[str], TextStream]:
    text = TextStream(tok.stream(skip), stop)
    pieces = []
    for i in ids:
        pieces.append(text.push(i, i in stop_ids))
        if text.stopped:
            break
    pieces.append(text.finish())
    return pieces, text


def byte_tokens(tok, s: str) -> list[int]:
    """One token per UTF-8 byte (the byte-level alphabet's ids): a character over several tokens."""
    return [tok.backend.token_to_id(c) for c in _byte_chars(s)]


def _byte_chars(s: str) -> list[str]:
    # GPT-2's bytes-to-unicode table: the byte-level alphabet's character for each byte.
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    table = dict(zip(bs, map(chr, cs)))
    return [table[b] for b in s.encode("utf-8")]


@pytest.mark.parametrize("text", ["The weight cache keeps héllo €uro 😀!", "東京 and Ελληνικά", "tab\tand\nnewline"])
def test_pieces_join_to_the_decoded_text_and_never_split_a_character(tok, text):
    for ids in (tok.encode(text, False), byte_tokens(tok, text)):
        pieces, stream = run(tok, ids)
        assert "".join(pieces) == stream.text == tok.decode(ids) == text
        assert "\ufffd" not in "".join(pieces)


def test_a_character_of_several_byte_tokens_is_sent_once_complete(tok):
    pieces, _ = run(tok, byte_tokens(tok, "a€b"))
    assert [p for p in pieces if p] == ["a", "€", "b"]


def test_a_cut_character_ends_as_the_tokenizers_decode_shows_it(tok):
    ids = byte_tokens(tok, "cut é")[:-1]  # max_tokens ends inside a character
    pieces, stream = run(tok, ids)
    assert "".join(pieces) == stream.text == tok.decode(ids) == "cut \ufffd"
    assert pieces[-1] == "\ufffd"  # held back until the end, never sent early


def test_random_ids_join_to_decode(tok):
    ids = torch.randint(0, 512, (400,), generator=torch.Generator().manual_seed(0)).tolist()
    pieces, stream = run(tok, ids)
    assert "".join(pieces) == tok.decode(ids)
    pieces, stream = run(tok, ids, skip=False)
    assert "".join(pieces) == tok.decode(ids, skip_special_tokens=False)


def test_special_tokens_skipped_or_shown_and_a_stop_id_adds_no_text(tok):
    ids = [*tok.encode("Hello", False), BOS_ID, *tok.encode(" world", False)]
    assert "".join(run(tok, ids)[0]) == "Hello world"
    assert "".join(run(tok, ids, skip=False)[0]) == "Hello<s> world"
    pieces, _ = run(tok, [*ids, EOS_ID], skip=False, stop_ids={EOS_ID})
    assert "".join(pieces) == "Hello<s> world"  # the EOS that ended it is not text, as vLLM


@pytest.mark.parametrize("stop,want", [
    (["lo"], "hel"),
    (["o w", "zz"], "hell"),
    (["€"], "hello w"),
    (["w€rld"], "hello "),  # a stop string spanning many tokens
    (["nope"], "hello w€rld!"),
])
def test_stop_strings_cut_the_text_before_the_first_found(tok, stop, want):
    pieces, text = run(tok, byte_tokens(tok, "hello w€rld!"), stop)
    assert "".join(pieces) == text.text == want
    assert text.stop_reason == (None if want == "hello w€rld!" else next(s for s in stop if s in "hello w€rld!"))


def test_without_a_tokenizer_there_is_no_text():
    stream = TextStream(None)
    assert stream.push(5) == "" and stream.finish() == "" and stream.text == ""
def test_params_travel_between_ranks_as_int64s():
    p = SamplingParams(0.7, 0.95, 12345)
    assert SamplingParams.from_ints(p.as_ints()) == p
    assert SamplingParams.from_ints(SamplingParams(1.0).as_ints()).seed is None
    assert SamplingParams(1.0).seeded().seed is not None and SamplingParams().seeded().seed is None


def test_sampling_is_greedy_at_0_reproducible_with_a_seed_and_top_p_bounds_the_choice():
    logits = torch.randn(50, generator=torch.Generator().manual_seed(0))
    assert Sampler(SamplingParams()).pick(logits) == int(torch.argmax(logits))
    draws = lambda seed, **kw: [s.pick(logits) for s in [Sampler(SamplingParams(1.0, seed=seed, **kw))] for _ in range(40)]
    assert draws(1) == draws(1) and draws(1) != draws(2)
    assert set(draws(3, top_p=1e-9)) == {int(torch.argmax(logits))}
    top = torch.softmax(logits, -1).sort(descending=True)
    nucleus = set(top.indices[:int((top.values.cumsum(0) < 0.5).sum()) + 1].tolist())
    assert set(draws(4, top_p=0.5)) <= nucleus
