"""vLLM's request fields beyond temperature, top_p and seed, checked as vLLM checks them: the
logits processing (top_k, min_p, the penalties, logit_bias, min_tokens), the stop rules
(stop_token_ids, ignore_eos, include_stop_str_in_output), how many choices (n) and which
log-probabilities (logprobs, top_logprobs, prompt_logprobs). Names, defaults, ranges and error
texts are vLLM's (errors.py). The answers' shapes are logprob_answers.py's.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

from wcache.errors import (
    BOOLEAN_FIELD, DRAFT_SAMPLING_FIELD, FREQUENCY_PENALTY, INTEGER_FIELD, LOGIT_BIAS_KEY, LOGIT_BIAS_SHAPE,
    LOGIT_BIAS_VOCAB, LOGPROBS_NEGATIVE, LOGPROBS_TOO_MANY, MIN_P, MIN_TOKENS, MIN_TOKENS_OVER_MAX, N_RANGE,
    NUMBER_FIELD, PRESENCE_PENALTY, PROMPT_LOGPROBS_NEGATIVE, PROMPT_LOGPROBS_STREAM, PROMPT_LOGPROBS_TOO_MANY,
    REPETITION_PENALTY, STOP_TOKEN_IDS, TOKEN_OUT_OF_VOCAB, TOP_K, TOP_LOGPROBS_NEGATIVE,
    TOP_LOGPROBS_WITHOUT_LOGPROBS,
)

# vLLM's --max-logprobs default: the most top log-probabilities a request may ask for.
MAX_LOGPROBS = 20

LOGIT_BIAS_LIMIT = 100.0  # vLLM clamps each bias to [-100, 100], as OpenAI documents


class FieldError(ValueError):
    """A field's value refused: the message and the field (openai_api turns it into a 400)."""

    def __init__(self, message: str, field: str):
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class StopRules:
    """vLLM's stop settings beyond ``stop``, as Engine.pieces takes them."""

    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    include_stop: bool = False  # include_stop_str_in_output

    def as_kwargs(self) -> dict:
        return {"stop_token_ids": self.stop_token_ids, "ignore_eos": self.ignore_eos,
                "include_stop": self.include_stop}


def _show(v) -> str:
    return json.dumps(v)[:32]


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def finite_number(v) -> bool:
    """A JSON number a float holds: not a boolean, NaN or infinity (Python's json reads ``NaN`` and
    ``Infinity``), nor an integer past float's range (``1`` and 400 zeros is valid JSON, and
    ``math.isfinite`` raises OverflowError on it instead of answering)."""
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        return False
    try:
        return math.isfinite(v)
    except OverflowError:
        return False


def number(req: dict, field: str, default: float) -> float:
    v = req.get(field)
    if v is None:
        return default
    if not finite_number(v):
        raise FieldError(NUMBER_FIELD.format(field=field, value=_show(v)), field)
    return float(v)


def integer(req: dict, field: str, default: int | None) -> int | None:
    v = req.get(field)
    if v is None:
        return default
    if not _is_int(v):
        raise FieldError(INTEGER_FIELD.format(field=field, value=_show(v)), field)
    return v


def boolean(req: dict, field: str) -> bool:
    v = req.get(field)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise FieldError(BOOLEAN_FIELD.format(field=field), field)
    return v


def processing(req: dict, vocab_size: int | None, max_tokens: int, has_draft: bool) -> dict:
    """SamplingParams' fields for top_k, min_p, the penalties, logit_bias and min_tokens."""
    top_k = integer(req, "top_k", 0)
    if top_k < -1:
        raise FieldError(TOP_K.format(value=top_k), "top_k")
    min_p = number(req, "min_p", 0.0)
    if not 0.0 <= min_p <= 1.0:
        raise FieldError(MIN_P.format(value=min_p), "min_p")
    presence = number(req, "presence_penalty", 0.0)
    if not -2.0 <= presence <= 2.0:
        raise FieldError(PRESENCE_PENALTY.format(value=presence), "presence_penalty")
    frequency = number(req, "frequency_penalty", 0.0)
    if not -2.0 <= frequency <= 2.0:
        raise FieldError(FREQUENCY_PENALTY.format(value=frequency), "frequency_penalty")
    repetition = number(req, "repetition_penalty", 1.0)
    if repetition <= 0.0:
        raise FieldError(REPETITION_PENALTY.format(value=repetition), "repetition_penalty")
    min_tokens = integer(req, "min_tokens", 0)
    if min_tokens < 0:
        raise FieldError(MIN_TOKENS.format(value=min_tokens), "min_tokens")
    if min_tokens > max_tokens:
        raise FieldError(MIN_TOKENS_OVER_MAX.format(max_tokens=max_tokens, value=min_tokens), "min_tokens")
    out = {"top_k": max(top_k, 0), "min_p": min_p, "presence_penalty": presence, "frequency_penalty": frequency,
           "repetition_penalty": repetition, "logit_bias": logit_bias(req.get("logit_bias"), vocab_size),
           "min_tokens": min_tokens}
    if has_draft:  # the speculative round picks argmaxes of raw logits
        changed = [f for f, neutral in (("presence_penalty", 0.0), ("frequency_penalty", 0.0),
                                        ("repetition_penalty", 1.0), ("logit_bias", ()), ("min_tokens", 0))
                   if out[f] != neutral]
        if changed:
            raise FieldError(DRAFT_SAMPLING_FIELD.format(field=changed[0]), changed[0])
    return out


def logit_bias(v, vocab_size: int | None) -> tuple[tuple[int, float], ...]:
    """``{"token id": bias}`` as (id, bias) pairs, in id order, each bias clamped to [-100, 100]."""
    if v is None:
        return ()
    if not isinstance(v, dict):
        raise FieldError(LOGIT_BIAS_SHAPE, "logit_bias")
    pairs = {}
    for key, bias in v.items():
        try:
            tid = int(key)
        except ValueError:
            raise FieldError(LOGIT_BIAS_KEY.format(key=str(key)[:32]), "logit_bias") from None
        if not finite_number(bias):
            raise FieldError(LOGIT_BIAS_SHAPE, "logit_bias")
        pairs[tid] = min(LOGIT_BIAS_LIMIT, max(-LOGIT_BIAS_LIMIT, float(bias)))
    bad = sorted(t for t in pairs if t < 0 or (vocab_size is not None and t >= vocab_size))
    if bad:
        raise FieldError(LOGIT_BIAS_VOCAB.format(ids=bad[:8], vocab=vocab_size), "logit_bias")
    return tuple(sorted(pairs.items()))


def stop_rules(req: dict, vocab_size: int | None) -> StopRules:
    ids = req.get("stop_token_ids")
    if ids is None:
        ids = []
    if not isinstance(ids, list) or not all(_is_int(i) for i in ids):
        raise FieldError(STOP_TOKEN_IDS, "stop_token_ids")
    bad = next((i for i in ids if i < 0 or (vocab_size is not None and i >= vocab_size)), None)
    if bad is not None:
        raise FieldError(TOKEN_OUT_OF_VOCAB.format(id=bad), "stop_token_ids")
    return StopRules(tuple(ids), boolean(req, "ignore_eos"), boolean(req, "include_stop_str_in_output"))


def choices(req: dict) -> int:
    n = integer(req, "n", 1)
    if n < 1:
        raise FieldError(N_RANGE.format(value=n), "n")
    return n


def _top(k: int, vocab_size: int | None, too_many: str, field: str) -> int:
    if k == -1:  # vLLM's: the whole vocabulary
        k = vocab_size if vocab_size is not None else MAX_LOGPROBS + 1
    if k > MAX_LOGPROBS:
        raise FieldError(too_many.format(n=k, max=MAX_LOGPROBS), field)
    return k


def completion_logprobs(req: dict, vocab_size: int | None) -> int | None:
    """Completions' ``logprobs``: how many top log-probabilities per token (None: none)."""
    k = integer(req, "logprobs", None)
    if k is None:
        return None
    if k < 0:
        raise FieldError(LOGPROBS_NEGATIVE, "logprobs")
    return _top(k, vocab_size, LOGPROBS_TOO_MANY, "logprobs")


def chat_logprobs(req: dict, vocab_size: int | None) -> int | None:
    """Chat's ``logprobs`` (true: the chosen tokens' log-probabilities) and ``top_logprobs`` (how
    many alternatives with each): the top count, or None without logprobs."""
    wanted = boolean(req, "logprobs")
    k = integer(req, "top_logprobs", None)
    if k is not None:
        if k < 0 and k != -1:
            raise FieldError(TOP_LOGPROBS_NEGATIVE, "top_logprobs")
        if k != 0 and not wanted:
            raise FieldError(TOP_LOGPROBS_WITHOUT_LOGPROBS, "top_logprobs")
    if not wanted:
        return None
    return _top(k or 0, vocab_size, LOGPROBS_TOO_MANY, "top_logprobs")


def prompt_logprobs(req: dict, vocab_size: int | None, stream: bool) -> int | None:
    """vLLM's ``prompt_logprobs``: top log-probabilities for each prompt token (None: none)."""
    k = integer(req, "prompt_logprobs", None)
    if k is None:
        return None
    if stream and (k > 0 or k == -1):
        raise FieldError(PROMPT_LOGPROBS_STREAM, "prompt_logprobs")
    if k < 0 and k != -1:
        raise FieldError(PROMPT_LOGPROBS_NEGATIVE, "prompt_logprobs")
    return _top(k, vocab_size, PROMPT_LOGPROBS_TOO_MANY, "prompt_logprobs")
