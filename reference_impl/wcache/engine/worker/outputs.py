"""What the sampler hands on for each token, in whichever process reads it (vLLM V1 keeps its
sampler's outputs in v1/outputs.py for the same reason): plain records, no torch, so the front
process (api_server) reads them as the engine core writes them (core_messages.py carries them)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Sampled:
    """One token as the engine loop hands it to the request's thread: its id and, when the request
    asked for log-probabilities, the token's logprob, its rank and the top ``k`` (id, logprob)."""

    id: int
    logprob: float | None = None
    rank: int | None = None
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True, slots=True)
class PromptScores:
    """The prompt's tokens scored (echo with logprobs, prompt_logprobs): one entry per prompt token,
    the first None (nothing precedes it), handed once before the first generated token."""

    ids: tuple[int, ...]
    entries: tuple[Sampled | None, ...]
