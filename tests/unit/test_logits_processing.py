"""vLLM's logits processing and log-probabilities on known rows (engine/worker/penalties.py, sampling.py,
logprobs.py): each setting moves the logits exactly as its formula says (the formulas
docs/serve-reference.md cites), and the scores are log_softmax of the raw logits."""

from __future__ import annotations

import pytest
import torch

from wcache.engine.worker.logprobs import score, score_prompt
from wcache.engine.worker.sampling import Sampler, SamplingParams
from wcache.engine.core.textstream import TextStream

ROW = torch.tensor([2.0, -1.0, 0.5, 3.0, -2.0, 1.0])


def processed(prompt=(), out=(), stop_ids=frozenset(), **kw) -> torch.Tensor:
    return Sampler(SamplingParams(**kw)).bind(list(prompt), list(out), frozenset(stop_ids)).processed(ROW.clone())


def test_repetition_divides_positive_and_multiplies_negative_logits_of_seen_tokens():
    got = processed(prompt=[0, 1], out=[5], repetition_penalty=2.0)
    # seen: 0 (2.0 > 0: halved), 1 (-1.0: doubled), 5 (1.0: halved); unseen 2, 3, 4 unchanged
    assert got.tolist() == [1.0, -2.0, 0.5, 3.0, -2.0, 0.5]


def test_frequency_subtracts_per_occurrence_in_the_output_only():
    got = processed(prompt=[2], out=[3, 3, 0], frequency_penalty=0.5)
    assert got.tolist() == [1.5, -1.0, 0.5, 2.0, -2.0, 1.0]  # 3 twice: -1.0; the prompt's 2 untouched


def test_presence_subtracts_once_per_token_in_the_output():
    got = processed(prompt=[2], out=[3, 3, 0], presence_penalty=0.5)
    assert got.tolist() == [1.5, -1.0, 0.5, 2.5, -2.0, 1.0]


def test_negative_penalties_raise_the_logits():
    got = processed(out=[4], presence_penalty=-1.0, frequency_penalty=-1.0)
    assert got[4] == pytest.approx(0.0) and got[0] == 2.0


def test_logit_bias_is_added_and_min_tokens_masks_the_stop_ids():
    got = processed(logit_bias=((1, 10.0), (3, -5.0)))
    assert got.tolist() == [2.0, 9.0, 0.5, -2.0, -2.0, 1.0]
    held = processed(out=[0], stop_ids={3}, min_tokens=2)
    assert held[3] == float("-inf") and held[0] == 2.0
    assert processed(out=[0, 0], stop_ids={3}, min_tokens=2)[3] == 3.0  # min_tokens reached: free again


def test_greedy_picks_the_argmax_after_the_penalties():
    assert Sampler(SamplingParams()).pick(ROW) == 3
    s = Sampler(SamplingParams(presence_penalty=2.0)).bind([], [3], frozenset())
    assert s.pick(ROW) == 0  # 3's logit 1.0 now, below 0's 2.0


def test_top_k_and_min_p_leave_only_the_tokens_their_formulas_keep():
    def drawn(**kw):
        s = Sampler(SamplingParams(1.0, seed=1, **kw))
        return {s.pick(ROW) for _ in range(300)}

    assert drawn(top_k=2) == {0, 3}
    # min_p 0.3: keep p >= 0.3 * p(3); p(0) / p(3) = e^-1 = 0.37, p(5) / p(3) = e^-2 = 0.14
    assert drawn(min_p=0.3) == {0, 3}
    assert drawn(top_k=1) == {3}
    assert len(drawn()) >= 5


def test_a_choice_is_seeded_seed_plus_its_index():
    p = SamplingParams(1.0, seed=7)
    assert [p.for_choice(j).seed for j in range(3)] == [7, 8, 9]
    assert SamplingParams(1.0).for_choice(2).seed is None


def test_scores_are_log_softmax_of_the_raw_logits_with_rank_and_top():
    lp = torch.log_softmax(ROW, -1)
    s = score(ROW, 5, 2)
    assert s.logprob == pytest.approx(float(lp[5])) and s.rank == 3
    assert [t for t, _ in s.top] == [3, 0] and s.top[0][1] == pytest.approx(float(lp[3]))
    # sampling settings never change the scores: they are the model's
    sampled = Sampler(SamplingParams(presence_penalty=2.0, logprobs=1)).bind([], [3], frozenset()).sample(ROW)
    assert sampled.id == 0 and sampled.logprob == pytest.approx(float(lp[0])) and sampled.top[0][0] == 3


def test_prompt_scores_use_the_position_before_each_token_and_leave_the_first_none():
    logits = torch.stack([ROW, ROW.flip(0), ROW * 2])  # positions 0, 1, 2 of a 3-token prompt
    scores = score_prompt(logits[:-1], [4, 3, 0], 1)
    assert scores.entries[0] is None and scores.ids == (4, 3, 0)
    assert scores.entries[1].logprob == pytest.approx(float(torch.log_softmax(ROW, -1)[3]))
    assert scores.entries[2].logprob == pytest.approx(float(torch.log_softmax(ROW.flip(0), -1)[0]))


class Letters:
    """A detokenizer of one letter per token id (0 -> a, 1 -> b, ...)."""

    def __init__(self):
        self.text = ""

    def push(self, token):
        self.text += chr(ord("a") + token)

    def flush(self):
        pass


def test_include_stop_keeps_the_stop_string_and_min_tokens_delays_it():
    def run(ids, **kw):
        ts = TextStream(Letters(), ["cd"], **kw)
        for t in ids:
            ts.push(t)
            if ts.stopped:
                break
        ts.finish()
        return ts.text, ts.stop_reason

    assert run([0, 1, 2, 3, 4]) == ("ab", "cd")
    assert run([0, 1, 2, 3, 4], include_stop=True) == ("abcd", "cd")
    assert run([2, 3, 0, 2, 3, 1], min_tokens=2) == ("cda", "cd")  # the first "cd" is within min_tokens


# -- the answers' shapes (logprob_answers.py) ------------------------------------------------------
def test_completion_logprobs_hold_the_chosen_token_and_the_top_k_and_go_on_across_parts():
    from wcache.engine.openai.logprob_answers import CompletionLogprobs
    from wcache.engine.worker.outputs import Sampled

    fmt = CompletionLogprobs(None, 2)  # no tokenizer: tokens named token_id:N, as vLLM names them then
    first = fmt.part([7, 3], [None, Sampled(3, -2.5, 4, ((1, -0.1), (2, -0.9), (3, -2.5)))])
    assert first["tokens"] == ["token_id:7", "token_id:3"] and first["token_logprobs"] == [None, -2.5]
    assert first["top_logprobs"] == [None, {"token_id:3": -2.5, "token_id:1": -0.1, "token_id:2": -0.9}]
    assert first["text_offset"] == [0, 10]
    second = fmt.part([1], [Sampled(1, float("-inf"), 1, ((1, float("-inf")),))])
    assert second["text_offset"] == [20] and second["token_logprobs"] == [-9999.0]  # -inf: JSON has none


def test_chat_logprobs_list_the_top_k_in_rank_order_and_prompt_logprobs_carry_ranks():
    from wcache.engine.openai.logprob_answers import chat_logprobs, prompt_logprobs
    from wcache.engine.worker.outputs import PromptScores, Sampled

    entry = Sampled(5, -1.5, 2, ((4, -0.5), (5, -1.5), (6, -3.0)))
    [one] = chat_logprobs(None, (entry,), 2)["content"]
    assert one["token"] == "token_id:5" and one["logprob"] == -1.5 and one["bytes"] == list(b"token_id:5")
    assert [t["token"] for t in one["top_logprobs"]] == ["token_id:4", "token_id:5"]
    scores = prompt_logprobs(None, PromptScores((9, 5), (None, entry)), 1)
    assert scores[0] is None
    assert scores[1] == {5: {"logprob": -1.5, "rank": 2, "decoded_token": "token_id:5"},
                         4: {"logprob": -0.5, "rank": 1, "decoded_token": "token_id:4"}}


# -- hostile values within the accepted ranges (docs/faults.md, "Sampling values at the ends of their ranges")
@pytest.mark.parametrize("kw", [
    {"temperature": 1e-300},  # 0 as float32: logits / 0 = inf (was: the softmax's NaN stopped the engine loop)
    {"temperature": 1e-40},  # a float32 denormal: 3.0 / 1e-40 overflows to inf
    {"temperature": 1.0, "repetition_penalty": 1e-40},  # a seen positive logit divided past float32
    {"temperature": 1.0, "repetition_penalty": 1e-50},  # 0 as float32: division by zero
    {"temperature": 1.0, "repetition_penalty": 1e39},  # inf as float32: 0 x inf is NaN
    {"temperature": 1.0, "repetition_penalty": 1e39, "min_tokens": 1},  # -inf (a held-back stop id) x 0
])
def test_settings_at_the_ends_of_their_ranges_still_draw_a_token(kw):
    row = torch.tensor([2.0, -1.0, 0.0, 3.0, -2.0, 1.0])
    for seed in range(20):
        s = Sampler(SamplingParams(seed=seed, **kw)).bind([0, 1, 2, 3], [], frozenset({4}))
        tok = s.pick(row.clone())
        assert 0 <= tok < 6 and not (kw.get("min_tokens") and tok == 4)  # a token; not a held-back stop id


def test_a_temperature_below_vllms_floor_draws_as_at_the_floor():
    """vLLM raises a temperature in (0, 0.01) to 0.01 (_MAX_TEMP): the same draws, seed for seed."""
    row = torch.tensor([2.0, 1.99, 1.98, -1.0])
    for seed in range(10):
        floor = Sampler(SamplingParams(temperature=0.01, seed=seed)).pick(row.clone())
        assert Sampler(SamplingParams(temperature=1e-30, seed=seed)).pick(row.clone()) == floor


def test_a_row_with_every_token_held_back_gets_greedys_pick_not_an_error():
    """min_tokens with every id a stop id leaves nothing to draw: the sampled pick is greedy's (was:
    torch.multinomial raised on the all-NaN probabilities, inside the engine loop)."""
    stop = frozenset(range(6))
    greedy = Sampler(SamplingParams(min_tokens=2)).bind([], [], stop).pick(ROW.clone())
    sampled = Sampler(SamplingParams(temperature=1.0, seed=3, min_tokens=2, top_k=2, min_p=0.5,
                                     top_p=0.5)).bind([], [], stop).pick(ROW.clone())
    assert sampled == greedy == 0


def test_a_bias_on_every_id_costs_a_step_about_what_one_bias_does():
    """A logit_bias on each of llama-8b's 128256 ids (a request body holds some 100000 of them,
    and the cost is per id), or min_tokens holding every id back, is
    processed on the engine thread at every step, for every sequence of the batch to wait on: its
    index tensors are made once, at bind (was: rebuilt from Python lists each step, about 360 and
    170 times the cost of one bias; now a few times)."""
    import time

    vocab = 128256
    row = torch.randn(vocab)

    def step_s(sampler: Sampler) -> float:
        sampler.pick(row)
        times = []
        for _ in range(15):
            t0 = time.perf_counter()
            sampler.pick(row)
            times.append(time.perf_counter() - t0)
        return min(times)  # the work's own cost: a preempted sample is only ever longer (it failed at a load of 14)

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the engine's other threads and other tests' load: one thread measures alike
    try:
        one = step_s(Sampler(SamplingParams(logit_bias=((5, 1.0),))).bind([], [], frozenset()))
        every = step_s(Sampler(SamplingParams(logit_bias=tuple((i, 1.0) for i in range(vocab)))).bind(
            [], [], frozenset()))
        held = step_s(Sampler(SamplingParams(min_tokens=5)).bind([], [], frozenset(range(vocab))))
    finally:
        torch.set_num_threads(threads)
    assert every < 25 * one and held < 25 * one, (every, held, one)
