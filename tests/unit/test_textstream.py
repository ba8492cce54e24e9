"""A completion's text as tokens arrive (engine/textstream.py) and how tokens are drawn
(engine/sampling.py): the pieces always join to the final text, stop strings cut it, and sampling
is greedy at temperature 0 and reproducible with a seed."""

from __future__ import annotations

import pytest
import torch
from wcache.engine.sampling import Sampler, SamplingParams
from wcache.engine.textstream import TextStream, unfinished_bytes
from wcache.model import tokenizer


def run(ids: list[int], stop=()) -> tuple[list[str], TextStream]:
    text = TextStream(stop)
    pieces = []
    for i in ids:
        pieces.append(text.push(i))
        if text.stopped:
            break
    pieces.append(text.finish())
    return pieces, text


def byte_ids(s: str) -> list[int]:
    return list(s.encode("utf-8"))


@pytest.mark.parametrize("ids", [
    byte_ids("héllo €uro 😀!"),
    byte_ids("cut mid-character é")[:-1],  # max_tokens ends inside a character: shown as \xNN
    [0xFF, 0x41, 0xE2, 0x82, 300, 0x41, tokenizer.EOS_ID],  # invalid bytes, an id with no text, EOS
    byte_ids("tab\tand\x1bescape"),
])
def test_pieces_join_to_the_decoded_text(ids):
    pieces, text = run(ids)
    assert "".join(pieces) == text.text == tokenizer.decode(ids)


def test_a_character_of_several_bytes_is_sent_once_complete():
    pieces, _ = run(byte_ids("a€b"))
    assert [p for p in pieces if p] == ["a", "€", "b"]


def test_unfinished_bytes_counts_only_the_start_of_a_valid_character():
    assert unfinished_bytes(byte_ids("x€")[:-1]) == 2
    assert unfinished_bytes(byte_ids("x😀")[:-3]) == 1
    assert unfinished_bytes([0x80]) == 0 and unfinished_bytes([0xE2, 0x41]) == 0 and unfinished_bytes([300]) == 0


@pytest.mark.parametrize("stop,want", [
    (["lo"], "hel"),
    (["o w", "zz"], "hell"),
    (["€"], "hello w"),
    (["w€rld"], "hello "),  # a stop string spanning many tokens
    (["nope"], "hello w€rld!"),
])
def test_stop_strings_cut_the_text_before_the_first_found(stop, want):
    pieces, text = run(byte_ids("hello w€rld!"), stop)
    assert "".join(pieces) == text.text == want
    assert text.stop_reason == (None if want == "hello w€rld!" else next(s for s in stop if s in "hello w€rld!"))


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
