"""What a request asks of the sampler, as the HTTP layer builds it: no torch here, so `wcache serve`'s
front process (engine/api_server/core_client.py) parses requests without it; sampling.py picks the tokens."""

from __future__ import annotations

import secrets
import struct
from dataclasses import dataclass, replace

# vLLM's _MAX_TEMP: a temperature above 0 and below it is raised to it (vLLM's SamplingParams does
# so with a warning), since dividing the logits by less overflows float32 to inf, whose softmax is
# NaN: torch.multinomial raised on it inside the engine loop, and every request failed after.
MIN_TEMPERATURE = 1e-2


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    top_k: int = 0  # 0 (or -1, vLLM's older spelling): every token
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias), the bias clamped to [-100, 100]
    min_tokens: int = 0
    logprobs: int | None = None  # top log-probabilities per generated token (None: no logprobs)
    prompt_logprobs: int | None = None  # the same for each prompt token (echo with logprobs, prompt_logprobs)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0)

    @property
    def plain(self) -> bool:
        """Greedy with nothing to change the logits and no logprobs: one argmax, on the device."""
        return (self.greedy and not self.penalized and not self.logit_bias and not self.min_tokens
                and self.logprobs is None)

    def seeded(self) -> SamplingParams:
        """These settings with a seed: the request's, or a fresh random one (sent to every rank)."""
        if self.greedy or self.seed is not None:
            return self
        return replace(self, seed=secrets.randbits(62))

    def for_choice(self, index: int) -> SamplingParams:
        """Choice ``index`` of ``n``: vLLM gives each its own sequence, seeded ``seed + index``, so
        a seeded request's choices differ from each other and are the same every time."""
        if self.seed is None or index == 0:
            return self
        return replace(self, seed=(self.seed + index) % 2**63)

    # The request header between ranks is int64s: floats travel as their IEEE-754 bits (the draw's
    # settings; rank 0 alone processes the logits).
    def as_ints(self) -> list[int]:
        return [_bits(self.temperature), _bits(self.top_p), -1 if self.seed is None else self.seed]

    @classmethod
    def from_ints(cls, ints: list[int]) -> SamplingParams:
        t, p, seed = ints
        return cls(_float(t), _float(p), None if seed < 0 else seed)


GREEDY = SamplingParams()


def _bits(x: float) -> int:
    return struct.unpack("<q", struct.pack("<d", x))[0]


def _float(i: int) -> float:
    return struct.unpack("<d", struct.pack("<q", i))[0]
