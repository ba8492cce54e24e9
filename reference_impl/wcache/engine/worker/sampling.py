"""How the next token is picked from the logits: greedy, or sampled, after vLLM's logits processing.

Temperature 0 is ``argmax``, exactly the engine's greedy decoding. Above it the logits are divided
by the temperature, the smallest set of tokens whose probability reaches ``top_p`` is kept, and one
is drawn with a CPU ``torch.Generator`` seeded from the request's ``seed`` (a random one when it has
none). Only engine rank 0 samples (the other ranks receive the picked token in the next step's
header, runner.py). In a batch every sequence keeps its own generator, and its row of the logits
is the logits it would have alone, so a seeded request draws the same tokens alone or batched.

Before the pick, a row goes through vLLM's (v1 sampler's) steps, in its order: ``min_tokens`` (the
stop ids cannot be picked yet), ``logit_bias`` (added), the penalties (penalties.py), then, when
sampling, temperature, ``min_p``, ``top_k`` and ``top_p``. Greedy is the argmax after the penalties
and bias. A row that asks for none of it is untouched: the plain greedy path stays one argmax.
"""

from __future__ import annotations

import secrets

import torch

from wcache.engine.worker.outputs import Sampled
from wcache.engine.worker.logprobs import score
from wcache.engine.worker.penalties import apply_penalties
from wcache.engine.worker.sampling_params import GREEDY, MIN_TEMPERATURE, SamplingParams  # noqa: F401 (GREEDY: the engine's)

_FLOAT32_MAX = torch.finfo(torch.float32).max


def _finite(logits: torch.Tensor) -> torch.Tensor:
    """A row every token of which has a finite logit or -inf: a penalty at an end of its range
    (repetition_penalty 1e-40 divides a positive logit past float32, 1e39 is inf as float32 and
    0 x inf is NaN) makes +inf the largest float (those tokens the most likely, alike) and NaN -inf
    (never drawn). vLLM lets them through; here a draw from NaN would stop the engine loop."""
    return torch.nan_to_num(logits, nan=float("-inf"), posinf=_FLOAT32_MAX, neginf=float("-inf"))


class Sampler:
    """Picks tokens for one sequence. ``bind`` gives it the sequence's prompt and output (penalties
    and ``min_tokens`` read them) and the ids ``min_tokens`` holds back (every stop id)."""

    def __init__(self, params: SamplingParams):
        self.params = params
        self.generator = None
        self.prompt: list[int] = []
        self.out: list[int] = []
        self.stop_ids: frozenset[int] = frozenset()
        # The index tensors of logit_bias and of the ids min_tokens holds back, made once by bind (on
        # the request's thread), moved to the logits' device at first use: built from Python lists
        # at every step, a bias on each of 128256 ids cost the engine thread some 68 ms per token
        # (every id held back, 32 ms), and every sequence in the batch waited for it.
        self._tensors: dict[str, torch.Tensor] = {}
        if not params.greedy:
            self.generator = torch.Generator(device="cpu")
            self.generator.manual_seed(params.seed if params.seed is not None else secrets.randbits(62))
        self.bind([], [], frozenset())  # a sampler used unbound (runner.decode) has its tensors too

    def bind(self, prompt: list[int], out: list[int], stop_ids: frozenset[int]) -> Sampler:
        self.prompt, self.out, self.stop_ids = prompt, out, stop_ids
        p = self.params
        self._tensors = {}
        if p.min_tokens and stop_ids:
            self._tensors["held"] = torch.tensor(sorted(stop_ids))
        if p.logit_bias:
            self._tensors["bias_ids"] = torch.tensor([i for i, _ in p.logit_bias])
            self._tensors["bias"] = torch.tensor([b for _, b in p.logit_bias], dtype=torch.float32)
        return self

    def _on(self, name: str, device) -> torch.Tensor:
        t = self._tensors[name]
        if t.device != device:
            t = self._tensors[name] = t.to(device)
        return t

    @property
    def plain(self) -> bool:
        return self.params.plain

    def processed(self, logits: torch.Tensor) -> torch.Tensor:
        """The row as vLLM's sampler sees it before temperature: min_tokens, logit bias, penalties."""
        p = self.params
        if not (p.min_tokens or p.logit_bias or p.penalized):
            return logits
        logits = logits.detach().float().clone()
        if len(self.out) < p.min_tokens and self.stop_ids:
            logits[self._on("held", logits.device)] = float("-inf")
        if p.logit_bias:
            logits[self._on("bias_ids", logits.device)] += self._on("bias", logits.device)
        if p.penalized:
            logits = apply_penalties(logits, self.prompt, self.out, p.presence_penalty, p.frequency_penalty,
                                     p.repetition_penalty)
        return _finite(logits)

    def pick(self, logits: torch.Tensor) -> int:
        return self.sample(logits).id

    def sample(self, logits: torch.Tensor) -> Sampled:
        """The next token, with its log-probabilities (of the raw ``logits``) when asked."""
        tok = self._pick(self.processed(logits))
        if self.params.logprobs is None:
            return Sampled(tok)
        return score(logits, tok, self.params.logprobs)

    def _pick(self, logits: torch.Tensor) -> int:
        if self.generator is None:
            return int(torch.argmax(logits))
        p = self.params
        logits = _finite(logits.detach().float().cpu() / max(p.temperature, MIN_TEMPERATURE))
        if not torch.isfinite(logits).any():  # every token held back (min_tokens, every id a stop id)
            return int(torch.argmax(logits))  # nothing to draw from: what greedy picks
        if p.min_p > 0.0:  # vLLM's: drop tokens less likely than min_p times the most likely one
            probs = torch.softmax(logits, dim=-1)
            logits = logits.masked_fill(probs < p.min_p * probs.max(), float("-inf"))
        if 0 < p.top_k < logits.shape[-1]:
            kth = torch.topk(logits, p.top_k).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        if p.top_p < 1.0:
            sorted_probs, order = torch.sort(probs, descending=True)
            before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs  # mass of the tokens ranked above
            sorted_probs[before >= p.top_p] = 0.0  # the top token always stays (its "before" is 0)
            probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
        return int(torch.multinomial(probs, 1, generator=self.generator))


def greedy_picks(samplers: list[Sampler], logits: torch.Tensor) -> torch.Tensor | None:
    """The batch's tokens as one argmax on the logits' device when every row is plain greedy (the
    common case: one kernel queued behind the pass, one device-to-host copy later), else None."""
    return logits.argmax(dim=-1) if all(s.plain for s in samplers) else None


def pick_rows(samplers: list[Sampler], logits: torch.Tensor, greedy: torch.Tensor | None = None) -> list[Sampled]:
    """One token per row of ``logits`` (B, vocab): ``greedy_picks`` (or ``greedy``, what it gave)
    when every row is plain greedy, else each row by its own sampler (with its logprobs if asked)."""
    if greedy is None:
        greedy = greedy_picks(samplers, logits)
    if greedy is not None:
        return [Sampled(t) for t in greedy.tolist()]
    return [s.sample(row) for s, row in zip(samplers, logits)]
