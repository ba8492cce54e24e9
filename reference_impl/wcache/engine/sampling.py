"""How the next token is picked from the logits: greedy, or sampled with temperature and top-p.

Temperature 0 is ``argmax``, exactly the engine's greedy decoding. Above it the logits are divided
by the temperature, the smallest set of tokens whose probability reaches ``top_p`` is kept, and one
is drawn with a CPU ``torch.Generator`` seeded from the request's ``seed`` (a random one when it has
none). Only engine rank 0 samples (the other ranks receive the picked token in the next step's
header, runner.py). In a batch every sequence keeps its own generator, and its row of the logits
is the logits it would have alone, so a seeded request draws the same tokens alone or batched.
"""

from __future__ import annotations

import secrets
import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
# torch is imported where a token is picked, not here: SamplingParams is what the HTTP layer builds,
# and `wcache serve`'s front process parses requests without torch (engine/core_client.py).


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def seeded(self) -> SamplingParams:
        """These settings with a seed: the request's, or a fresh random one (sent to every rank)."""
        if self.greedy or self.seed is not None:
            return self
        return SamplingParams(self.temperature, self.top_p, secrets.randbits(62))

    # The request header between ranks is int64s: floats travel as their IEEE-754 bits.
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


class Sampler:
    """Picks tokens for one sequence."""

    def __init__(self, params: SamplingParams):
        self.params = params
        self.generator = None
        if not params.greedy:
            import torch

            self.generator = torch.Generator(device="cpu")
            self.generator.manual_seed(params.seed if params.seed is not None else secrets.randbits(62))

    def pick(self, logits: torch.Tensor) -> int:
        import torch

        if self.generator is None:
            return int(torch.argmax(logits))
        p = self.params
        probs = torch.softmax(logits.detach().float().cpu() / p.temperature, dim=-1)
        if p.top_p < 1.0:
            sorted_probs, order = torch.sort(probs, descending=True)
            before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs  # mass of the tokens ranked above
            sorted_probs[before >= p.top_p] = 0.0  # the top token always stays (its "before" is 0)
            probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
        return int(torch.multinomial(probs, 1, generator=self.generator))


def greedy_picks(samplers: list[Sampler], logits: torch.Tensor) -> torch.Tensor | None:
    """The batch's tokens as one argmax on the logits' device when every row is greedy (the common
    case: one kernel queued behind the pass, one device-to-host copy later), else None."""
    return logits.argmax(dim=-1) if all(s.generator is None for s in samplers) else None


def pick_rows(samplers: list[Sampler], logits: torch.Tensor, greedy: torch.Tensor | None = None) -> list[int]:
    """One token per row of ``logits`` (B, vocab): ``greedy_picks`` (or ``greedy``, what it gave)
    when every row is greedy, else each row by its own sampler."""
    if greedy is None:
        greedy = greedy_picks(samplers, logits)
    if greedy is not None:
        return greedy.tolist()
    return [s.pick(row) for s, row in zip(samplers, logits)]
