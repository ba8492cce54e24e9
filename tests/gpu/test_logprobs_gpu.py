"""Log-probabilities and ``n`` on a GPU (engine/worker/logprobs.py, sampling.py, fanout.py): each score is
``log_softmax`` of the very logits the pass gave (the runner's trace), computed on the device; a
request's tokens and scores are the same alone and in a batch through CUDA graphs (the prompt's
scores come from an eager pass of every position); ``n`` choices run as their own sequences, choice
j the same as a lone request seeded ``seed + j``."""

from __future__ import annotations

import json

import pytest
import torch
from batching_requests import together
from wcache.core.checkpoint import make_checkpoint
from wcache.core.config import EngineConfig
from wcache.engine.openai import fanout
from wcache.engine.openai import openai_api as api
from wcache.engine.core.engine import Engine
from wcache.engine.worker.runner import EngineOptions
from wcache.engine.worker.sampling_params import SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device; run `make test-gpu` on one"),
]
PROMPTS = ["The weight cache", "Hello", "A longer prompt than the others here", "Hi"]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    tiny = make_checkpoint(tmp_path_factory.mktemp("logprobs-gpu") / "tiny", "tiny")
    cfg = EngineConfig.build(str(tiny), "bfloat16", None, "cuda")
    eng = Engine.start(cfg, EngineOptions("safetensors", enable_autotune=False, max_num_seqs=32))
    yield eng
    eng.close()


def scored(c) -> list:
    return [(s.id, s.logprob, s.rank, s.top) for s in c.logprobs]


def test_scores_are_log_softmax_of_the_passes_logits(engine):
    engine.runner.trace = []
    try:
        c = engine.generate("Hello", 12, SamplingParams(logprobs=5))
        trace = list(engine.runner.trace)
    finally:
        engine.runner.trace = None
    assert len(c.logprobs) == len(c.token_ids) == 12 and len(trace) >= 12
    for s, logits in zip(c.logprobs, trace[-12:]):  # the request's passes, one per token
        row = torch.log_softmax(logits.reshape(-1, logits.shape[-1])[-1].float(), -1)
        assert s.id == int(row.argmax()) and abs(s.logprob - float(row[s.id])) < 1e-5
        assert [t for t, _ in s.top] == torch.topk(row, 5).indices.tolist()


def test_tokens_and_scores_are_the_same_alone_and_in_a_batch(engine):
    asks = [SamplingParams(logprobs=3), SamplingParams(0.9, seed=11, logprobs=2, presence_penalty=0.5),
            SamplingParams(logprobs=1, prompt_logprobs=2), SamplingParams(1.0, seed=4, logprobs=4, top_k=20)]
    reqs = [(PROMPTS[i % len(PROMPTS)], 24, asks[i % len(asks)]) for i in range(16)]
    alone = [engine.generate(*r) for r in reqs]
    batched = together(lambda i: engine.generate(*reqs[i]), len(reqs))
    assert [c.token_ids for c in batched] == [c.token_ids for c in alone]
    assert [scored(c) for c in batched] == [scored(c) for c in alone]
    assert [c.prompt_logprobs for c in batched] == [c.prompt_logprobs for c in alone]
    assert alone[2].prompt_logprobs is not None and alone[2].prompt_logprobs.entries[0] is None


def test_n_choices_are_their_own_sequences_seeded_seed_plus_j(engine):
    body = {"prompt": "Hello", "max_tokens": 16, "temperature": 1.0, "seed": 7, "n": 4, "logprobs": 2}
    req = api.parse_completion_request(json.dumps(body).encode(), engine.max_model_len,
                                       vocab_size=engine.cfg.hf["vocab_size"], tokenizer=engine.tokenizer)
    done = fanout.run_all(engine, req.choice_prompts(), req)
    alone = [engine.generate("Hello", 16, SamplingParams(1.0, seed=7 + j, logprobs=2)) for j in range(4)]
    assert [c.token_ids for c in done] == [c.token_ids for c in alone]
    assert [scored(c) for c in done] == [scored(c) for c in alone]
    assert len({tuple(c.token_ids) for c in done}) > 1
    answer = api.completion_body("cmpl-x", "tiny", done, req, engine.tokenizer)
    assert answer["usage"]["completion_tokens"] == 64 and answer["usage"]["prompt_tokens"] == done[0].prompt_tokens
