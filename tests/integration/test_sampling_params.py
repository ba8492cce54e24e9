"""vLLM's sampling and scoring parameters through a real `wcache serve` (tiny preset, bfloat16 on
CPU, its chat template) and the official `openai` client: stop ids, EOS rules, top_k and min_p,
logprobs, echo, prompt_logprobs, n, the penalties and logit_bias, streamed and not, and the
batching promise (a request's tokens and logprobs are the same alone and among others).

The penalties are checked through the logprobs, which are the model's own (raw, as vLLM's): at
every step the token picked must be the argmax of the raw logprobs moved by the formula."""

from __future__ import annotations

import threading

import openai
import pytest
from procs import _healthy, free_port

from wcache.core.checkpoint_tokenizer import EOS_ID
from wcache.model.tokenizer import Tokenizer

MAX_MODEL_LEN = 96
NAME = "tiny"
HELLO = [{"role": "user", "content": "Hello"}]


@pytest.fixture(scope="module")
def engine(module_procs, tiny_model):
    port = free_port()
    p = module_procs.start("serve", str(tiny_model), "--device", "cpu", "--host", "127.0.0.1", "--port", str(port),
                           "--max-model-len", str(MAX_MODEL_LEN), "--no-enable-autotune", "--served-model-name", NAME,
                           name="serve-sampling")
    p.port = port
    return p.wait_for(lambda: _healthy(port), what="/health 200")


@pytest.fixture(scope="module")
def client(engine):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{engine.port}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def tok(tiny_model):
    return Tokenizer.load(str(tiny_model))


def complete(client, **kw):
    return client.completions.create(model=NAME, prompt="Hello", **{"max_tokens": 16, **kw})


def as_ids(**kw) -> dict:
    """vLLM's return_tokens_as_token_ids: logprobs keyed ``token_id:N`` (byte tokens that are
    pieces of one character all decode to U+FFFD, so their texts collide)."""
    return {**kw, "extra_body": {**kw.get("extra_body", {}), "return_tokens_as_token_ids": True}}


def tid(text: str) -> int:
    assert text.startswith("token_id:"), text
    return int(text[len("token_id:"):])


@pytest.fixture(scope="module")
def greedy(client):
    return complete(client, max_tokens=24)


# -- stop ids, EOS, min_tokens, top_k, min_p -----------------------------------------------------
def test_stop_token_ids_end_the_completion_with_the_id_as_stop_reason(client, greedy, tok):
    ids = greedy.choices[0].token_ids
    k = next(i for i in range(2, len(ids)) if ids[i] not in ids[:i])
    c = complete(client, max_tokens=24, extra_body={"stop_token_ids": [ids[k]]}).choices[0]
    assert c.token_ids == ids[:k + 1] and c.finish_reason == "stop" and c.model_extra["stop_reason"] == ids[k]
    assert c.text == tok.decode(ids[:k])  # the stop id's text left out, as vLLM
    kept = complete(client, max_tokens=24, extra_body={"stop_token_ids": [ids[k]],
                                                       "include_stop_str_in_output": True}).choices[0]
    assert kept.text == tok.decode(ids[:k + 1])


def test_include_stop_str_in_output_keeps_the_stop_string(client, greedy):
    text = greedy.choices[0].text
    stop = text[4:6]
    c = complete(client, max_tokens=24, stop=stop, extra_body={"include_stop_str_in_output": True}).choices[0]
    assert c.text == text[:text.find(stop) + len(stop)] and c.finish_reason == "stop"


def test_ignore_eos_and_min_tokens_hold_the_eos_back(client):
    eos = {str(EOS_ID): 100}  # EOS the argmax at every step
    assert complete(client, logit_bias=eos).choices[0].token_ids == [EOS_ID]
    fixed = complete(client, max_tokens=5, logit_bias=eos, extra_body={"ignore_eos": True}).choices[0]
    assert fixed.token_ids == [EOS_ID] * 5 and fixed.finish_reason == "length"
    held = complete(client, max_tokens=8, logit_bias=eos, extra_body={"min_tokens": 3}).choices[0]
    assert len(held.token_ids) == 4 and EOS_ID not in held.token_ids[:3] and held.token_ids[3] == EOS_ID
    assert held.finish_reason == "stop" and held.model_extra["stop_reason"] is None


def test_top_k_1_and_min_p_1_leave_only_the_greedy_token(client, greedy):
    for extra in ({"top_k": 1}, {"min_p": 1.0}):
        c = complete(client, max_tokens=24, temperature=1.5, seed=4, extra_body=extra).choices[0]
        assert c.token_ids == greedy.choices[0].token_ids, extra
    wide = complete(client, max_tokens=24, temperature=1.5, seed=4, extra_body={"top_k": 5}).choices[0]
    assert wide.token_ids != greedy.choices[0].token_ids


# -- logprobs ------------------------------------------------------------------------------------
def test_completion_logprobs_score_every_token_with_the_top_k(client, greedy, tok):
    texts = complete(client, max_tokens=24, logprobs=3).choices[0].logprobs
    assert texts.tokens == [tok.decode([t], skip_special_tokens=False) for t in greedy.choices[0].token_ids]
    c = complete(client, **as_ids(max_tokens=24, logprobs=3)).choices[0]
    lp = c.logprobs
    assert c.token_ids == greedy.choices[0].token_ids and [tid(t) for t in lp.tokens] == c.token_ids
    assert lp.token_logprobs == texts.token_logprobs
    assert len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == len(c.token_ids)
    for t, chosen, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert chosen <= 0 and top[t] == chosen and len(top) in (3, 4)
        assert chosen == max(top.values())  # greedy: the chosen token is the most likely
    assert lp.text_offset == [sum(len(x) for x in lp.tokens[:i]) for i in range(len(lp.tokens))]


def test_streamed_logprobs_are_the_plain_ones(client):
    whole = complete(client, max_tokens=12, logprobs=2, temperature=1.0, seed=9).choices[0].logprobs
    chunks = list(complete(client, max_tokens=12, logprobs=2, temperature=1.0, seed=9, stream=True))
    parts = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
    assert [t for p in parts for t in p.tokens] == whole.tokens
    assert [x for p in parts for x in p.token_logprobs] == whole.token_logprobs
    assert [x for p in parts for x in p.top_logprobs] == whole.top_logprobs
    assert [x for p in parts for x in p.text_offset] == whole.text_offset


def test_chat_logprobs_and_top_logprobs(client, tok):
    c = client.chat.completions.create(model=NAME, messages=HELLO, max_tokens=10, logprobs=True, top_logprobs=4,
                                       extra_body={"return_tokens_as_token_ids": True})
    content = c.choices[0].logprobs.content
    assert len(content) == c.usage.completion_tokens
    for e in content:
        assert len(e.top_logprobs) == 4 and e.bytes == list(e.token.encode())
        assert [t.logprob for t in e.top_logprobs] == sorted((t.logprob for t in e.top_logprobs), reverse=True)
        assert e.top_logprobs[0].token == e.token and e.top_logprobs[0].logprob == e.logprob  # greedy
    chunks = list(client.chat.completions.create(model=NAME, messages=HELLO, max_tokens=10, logprobs=True,
                                                 top_logprobs=4, stream=True,
                                                 extra_body={"return_tokens_as_token_ids": True}))
    streamed = [e for ch in chunks if ch.choices and ch.choices[0].logprobs for e in ch.choices[0].logprobs.content]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content]
    plain = client.chat.completions.create(model=NAME, messages=HELLO, max_tokens=10, logprobs=True)
    assert [e.top_logprobs for e in plain.choices[0].logprobs.content] == [[]] * len(content)


# -- echo and prompt logprobs ---------------------------------------------------------------------
def test_echo_puts_the_prompt_first_and_scores_it_with_the_first_token_null(client, greedy, tok):
    c = complete(client, max_tokens=4, echo=True, logprobs=1).choices[0]
    prompt_ids = tok.encode("Hello")
    assert c.text == "Hello" + tok.decode(c.token_ids)
    lp = c.logprobs
    assert len(lp.tokens) == len(prompt_ids) + 4 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(x is not None and x <= 0 for x in lp.token_logprobs[1:])
    assert c.token_ids == greedy.choices[0].token_ids[:4]
    plain = complete(client, max_tokens=4, echo=True).choices[0]
    assert plain.text == c.text and plain.logprobs is None
    chunks = list(complete(client, max_tokens=4, echo=True, logprobs=1, stream=True))
    assert chunks[0].choices[0].text.startswith("Hello")
    assert [t for ch in chunks if ch.choices and ch.choices[0].logprobs for t in ch.choices[0].logprobs.token_logprobs] \
        == lp.token_logprobs


def test_prompt_logprobs_list_each_prompt_token_with_its_rank(client, tok):
    c = complete(client, max_tokens=2, extra_body={"prompt_logprobs": 2}).choices[0]
    echoed = complete(client, max_tokens=2, echo=True, logprobs=2).choices[0].logprobs
    scores = c.model_extra["prompt_logprobs"]
    ids = tok.encode("Hello")
    assert len(scores) == len(ids) and scores[0] is None
    for i, (tid, entry) in enumerate(zip(ids[1:], scores[1:]), 1):
        mine = entry[str(tid)]
        assert mine["logprob"] == echoed.token_logprobs[i] and mine["rank"] >= 1
        assert mine["decoded_token"] == tok.decode([tid], skip_special_tokens=False)
        ranked = sorted((e for k, e in entry.items() if k != str(tid) or e["rank"] <= 2), key=lambda e: e["rank"])
        assert [e["rank"] for e in ranked][:2] == [1, 2]


# -- n --------------------------------------------------------------------------------------------
def test_n_choices_are_each_seeded_seed_plus_their_index(client):
    c = complete(client, max_tokens=12, temperature=1.0, seed=11, n=3)
    assert [ch.index for ch in c.choices] == [0, 1, 2]
    alone = [complete(client, max_tokens=12, temperature=1.0, seed=11 + j).choices[0].token_ids for j in range(3)]
    assert [ch.token_ids for ch in c.choices] == alone
    assert len({tuple(a) for a in alone}) > 1  # different draws
    assert c.usage.prompt_tokens == 4 and c.usage.completion_tokens == sum(len(a) for a in alone)
    again = complete(client, max_tokens=12, temperature=1.0, seed=11, n=3)
    assert [ch.text for ch in again.choices] == [ch.text for ch in c.choices]


def test_n_with_several_prompts_and_streamed(client):
    c = client.completions.create(model=NAME, prompt=["Hello", "Hi"], max_tokens=6, temperature=1.0, seed=3, n=2)
    assert [ch.index for ch in c.choices] == [0, 1, 2, 3]
    chunks = list(client.completions.create(model=NAME, prompt=["Hello", "Hi"], max_tokens=6, temperature=1.0,
                                            seed=3, n=2, stream=True, stream_options={"include_usage": True}))
    texts = ["", "", "", ""]
    for ch in chunks:
        for choice in ch.choices:
            texts[choice.index] += choice.text
    assert texts == [ch.text for ch in c.choices] and chunks[-1].usage == c.usage


def test_chat_n(client):
    c = client.chat.completions.create(model=NAME, messages=HELLO, max_tokens=8, temperature=1.0, seed=5, n=2)
    assert [ch.index for ch in c.choices] == [0, 1]
    one = client.chat.completions.create(model=NAME, messages=HELLO, max_tokens=8, temperature=1.0, seed=6)
    assert c.choices[1].message.content == one.choices[0].message.content
    assert c.usage.prompt_tokens == one.usage.prompt_tokens
    chunks = list(client.chat.completions.create(model=NAME, messages=HELLO, max_tokens=8, temperature=1.0, seed=5,
                                                 n=2, stream=True))
    texts = ["", ""]
    for ch in chunks:
        for choice in ch.choices:
            texts[choice.index] += choice.delta.content or ""
    assert texts == [ch.message.content for ch in c.choices]


# -- penalties and logit bias ---------------------------------------------------------------------
def picks_follow(choice, moved) -> int:
    """Every step's pick is the argmax of the raw logprobs moved by ``moved(lp, token, earlier)``,
    among the top 20 (valid when the winner beats the 20th unmoved logprob: penalties here only
    lower a logit). Returns the number of steps whose pick the penalty changed."""
    lp, changed = choice.logprobs, 0
    ids = choice.token_ids
    for i, (chosen, top) in enumerate(zip(ids, lp.top_logprobs)):
        raw = dict(top)  # "token_id:N" -> raw logprob
        scored = {t: moved(v, t, lp.tokens[:i]) for t, v in raw.items()}
        best = max(scored, key=scored.get)
        assert scored[best] >= min(raw.values()), "the winner might lie outside the top 20"
        assert lp.tokens[i] == best, (i, lp.tokens[i], best)
        changed += best != max(raw, key=raw.get)
    return changed


@pytest.mark.parametrize("presence,frequency", [(1.5, 0.0), (0.0, 0.7), (0.5, 0.5)])
def test_presence_and_frequency_move_each_pick_by_their_formula(client, presence, frequency):
    c = complete(client, **as_ids(max_tokens=32, logprobs=20, presence_penalty=presence, frequency_penalty=frequency))
    changed = picks_follow(c.choices[0], lambda v, t, before: v - frequency * before.count(t)
                           - presence * (t in before))
    assert changed > 0  # the penalty did pick otherwise somewhere


def test_logit_bias_adds_to_the_logit(client, greedy, tok):
    second = greedy.choices[0].token_ids[1]
    text = f"token_id:{second}"
    c = complete(client, **as_ids(max_tokens=16, logprobs=20, logit_bias={str(second): 3.0}))
    changed = picks_follow(c.choices[0], lambda v, t, before: v + 3.0 * (t == text))
    assert changed > 0


def test_repetition_penalty_changes_the_output(client, greedy):
    c = complete(client, max_tokens=24, extra_body={"repetition_penalty": 2.0}).choices[0]
    assert c.token_ids != greedy.choices[0].token_ids


# -- the batching promise -------------------------------------------------------------------------
def test_tokens_and_logprobs_are_the_same_alone_and_in_a_batch(client):
    asks = [dict(temperature=1.0, seed=21, logprobs=5, presence_penalty=0.5),
            dict(logprobs=3, echo=True),
            dict(temperature=0.8, seed=5, n=2, logprobs=1, extra_body={"top_k": 20, "min_p": 0.05})]
    alone = [complete(client, max_tokens=20, **kw) for kw in asks]
    batched: list = [None] * (3 * len(asks))

    def run(i):
        batched[i] = complete(client, max_tokens=20, **asks[i % len(asks)])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(batched))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    for i, b in enumerate(batched):
        a = alone[i % len(asks)]
        assert [(ch.token_ids, ch.logprobs) for ch in b.choices] == [(ch.token_ids, ch.logprobs) for ch in a.choices]
