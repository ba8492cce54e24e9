"""vLLM's three penalties on one row of logits, as its v1 sampler applies them (apply_penalties).

- repetition (the CTRL paper's, as Hugging Face and vLLM apply it): a token already in the prompt
  or the output has its logit divided by the penalty if positive, multiplied by it if not;
- frequency (OpenAI's definition): ``logit -= frequency_penalty * count``, count its occurrences
  in the output so far;
- presence (OpenAI's): ``logit -= presence_penalty`` if it occurs in the output at all.

Frequency and presence look at the output only, repetition at the prompt too (as vLLM does).
"""

from __future__ import annotations

import torch


def apply_penalties(logits: torch.Tensor, prompt: list[int], out: list[int], presence: float, frequency: float,
                    repetition: float) -> torch.Tensor:
    """``logits`` (vocab,) float32, changed in place and returned."""
    vocab, dev = logits.shape[-1], logits.device
    counts = torch.zeros(vocab, dtype=torch.float32, device=dev)
    if out:
        counts.index_add_(0, torch.tensor(out, device=dev), torch.ones(len(out), device=dev))
    in_out = counts > 0
    if repetition != 1.0:
        seen = in_out.clone()
        if prompt:
            seen[torch.tensor(prompt, device=dev)] = True
        scale = torch.where(seen, torch.tensor(repetition, device=dev), torch.tensor(1.0, device=dev))
        logits = torch.where(logits > 0, logits / scale, logits * scale)
    if frequency != 0.0:
        logits -= frequency * counts
    if presence != 0.0:
        logits -= presence * in_out.float()
    return logits
