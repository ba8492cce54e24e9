"""Log-probabilities as vLLM returns them (the records they fill are completion.py's).

vLLM's default (``logprobs_mode="raw_logprobs"``) scores a token by ``log_softmax`` of the model's
own logits, before temperature, penalties, logit bias or any truncation touch them: the numbers
describe the model, not the sampler. So do these. A position's answer is the chosen token's
logprob and rank (1 = the most likely) and the ``k`` most likely (id, logprob) pairs, rank order.
Formatting them as OpenAI's objects is the API layer's (openai_api.py, chat.py).
"""

from __future__ import annotations

import torch

from wcache.engine.worker.outputs import PromptScores, Sampled


def score(row: torch.Tensor, token: int, k: int) -> Sampled:
    """``token`` scored by one row of raw logits (vocab,): its logprob, rank and the top ``k``."""
    lp = torch.log_softmax(row.detach().float(), dim=-1)
    return _scored(lp, token, k)


def _scored(lp: torch.Tensor, token: int, k: int) -> Sampled:
    mine = lp[token]
    rank = int((lp > mine).sum()) + 1
    top = ()
    if k > 0:
        vals, ids = torch.topk(lp, min(k, lp.shape[-1]))
        top = tuple(zip(ids.tolist(), vals.tolist()))
    return Sampled(token, float(mine), rank, top)


def score_prompt(logits: torch.Tensor, prompt: list[int], k: int) -> PromptScores:
    """Every prompt token scored by the logits of the position before it: ``logits`` (T, vocab) of
    each prompt position; the first token has no score (None), as vLLM and OpenAI give it."""
    lp = torch.log_softmax(logits.detach().float(), dim=-1)
    return PromptScores(tuple(prompt), (None, *(_scored(lp[i - 1], prompt[i], k) for i in range(1, len(prompt)))))
