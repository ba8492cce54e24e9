"""Log-probabilities in the answers' shapes, as vLLM writes them (its serving_completion.py and
serving_chat.py): the completions API's legacy object, chat's ``content`` list, and vLLM's own
``prompt_logprobs`` list. The numbers come from the engine (logprobs.py's records); a token's
text is its own decoding (``token_id:N`` without a tokenizer, as vLLM's return_tokens_as_token_ids).
A logprob of minus infinity, which JSON cannot carry, is -9999.0, as vLLM and OpenAI send it.
"""

from __future__ import annotations

from wcache.engine.worker.outputs import PromptScores, Sampled

FLOOR = -9999.0


def token_text(tokenizer, token: int) -> str:
    if tokenizer is None:
        return f"token_id:{token}"
    return tokenizer.decode([token], skip_special_tokens=False)


def _lp(x: float) -> float:
    return max(x, FLOOR)


class CompletionLogprobs:
    """The completions API's ``logprobs`` object for one choice, built as tokens come (a stream
    sends each chunk's part; ``text_offset`` goes on from where the last part ended)."""

    def __init__(self, tokenizer, k: int):
        self.tokenizer, self.k, self.offset = tokenizer, k, 0

    def part(self, ids, entries) -> dict:
        """``entries``: a Sampled record per id, or None (a first prompt token, not scored)."""
        out = {"text_offset": [], "token_logprobs": [], "tokens": [], "top_logprobs": []}
        for tid, e in zip(ids, entries):
            text = token_text(self.tokenizer, tid)
            out["tokens"].append(text)
            out["text_offset"].append(self.offset)
            self.offset += len(text)
            if e is None:
                out["token_logprobs"].append(None)
                out["top_logprobs"].append(None)
                continue
            out["token_logprobs"].append(_lp(e.logprob))
            # the chosen token and the top k (k + 1 entries when it is not among them), as OpenAI documents
            pairs = {e.id: e.logprob}
            for tid2, lp in e.top[:self.k]:
                pairs.setdefault(tid2, lp)
            out["top_logprobs"].append({token_text(self.tokenizer, t): _lp(lp) for t, lp in pairs.items()})
        return out


def chat_logprobs(tokenizer, entries: tuple[Sampled, ...], k: int) -> dict:
    """Chat's ``logprobs``: ``{"content": [...]}``, one object per token, its top ``k`` alternatives
    in rank order."""
    def one(tid: int, lp: float) -> dict:
        text = token_text(tokenizer, tid)
        return {"token": text, "logprob": _lp(lp), "bytes": list(text.encode("utf-8", errors="replace"))}

    return {"content": [{**one(e.id, e.logprob), "top_logprobs": [one(t, lp) for t, lp in e.top[:k]]}
                        for e in entries]}


def prompt_logprobs(tokenizer, scores: PromptScores, k: int) -> list:
    """vLLM's ``prompt_logprobs``: None for the first token, then ``{id: {logprob, rank,
    decoded_token}}`` holding the prompt token and the top ``k``."""
    out: list = []
    for e in scores.entries:
        if e is None:
            out.append(None)
            continue
        d = {e.id: {"logprob": _lp(e.logprob), "rank": e.rank, "decoded_token": token_text(tokenizer, e.id)}}
        for rank, (tid, lp) in enumerate(e.top[:k], 1):
            d.setdefault(tid, {"logprob": _lp(lp), "rank": rank, "decoded_token": token_text(tokenizer, tid)})
        out.append(d)
    return out
