"""What a request gets back from the engine, in whichever process runs the HTTP layer: the
Completion (of outputs.py's token records) and the end of a sequence's stream of tokens, and the
loop that reads them on the request's thread. No torch here: `wcache serve`'s front
process (engine/api_server/core_client.py) builds them from the token ids its engine core sends."""

from __future__ import annotations

import time
from dataclasses import dataclass

from wcache.engine.worker.outputs import PromptScores, Sampled

# Tokens a request's thread may fall behind the engine loop (a streaming client that stops reading,
# once the socket's buffers are full) before the engine ends that request and frees its slot.
STREAM_BUFFER_TOKENS = 256


@dataclass(frozen=True)
class Completion:
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" (EOS or a stop string) or "length"
    stop_reason: str | int | None  # the stop string or stop_token_ids id that ended it (None for EOS or length)
    prompt_tokens: int
    first_token_at: float | None = None  # time.monotonic() of the first token (the metrics' time to first token)
    logprobs: tuple[Sampled, ...] = ()  # one per token of token_ids, when the request asked for logprobs
    prompt_logprobs: PromptScores | None = None  # when it asked for the prompt's (echo, prompt_logprobs)
    prompt_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class _End:
    """The last item of a sequence's outbox: why it ended ("eos", "length", "cancelled",
    "overflow", "abort" when the engine stops, "error" when the engine loop failed)."""

    reason: str
    error: BaseException | None = None


def finish_reason(end: _End | None, text_stopped: bool, out: list[int], stop_ids) -> str:
    """The Completion's finish reason, as vLLM names it."""
    if end is not None and end.reason in ("overflow", "abort"):
        return "abort"  # vLLM's finish reason for a request the engine ended
    return "stop" if text_stopped or (out and out[-1] in stop_ids) else "length"


def stop_reason(text_stop: str | None, finish: str, out: list[int], own_stops, eos: int | None) -> str | int | None:
    """vLLM's stop reason: the stop string, or the stop_token_ids id that ended it (not the EOS id)."""
    if finish == "stop" and text_stop is None and out and out[-1] in own_stops and out[-1] != eos:
        return out[-1]
    return text_stop


def read_completion(get, cancel, prompt_ids: list[int], stop_ids: frozenset[int], own_stops: frozenset[int],
                    eos: int | None, text, each_token: bool):
    """A request's tokens as its HTTP thread reads them, in whichever process the engine runs: a
    generator of text pieces (textstream.TextPiece) that returns the Completion.

    ``get()`` gives the next item the engine handed this request (a ``Sampled``, the prompt's
    ``PromptScores`` once before the first token, then an ``_End``); ``cancel()`` stops the request
    at its next token (a stop string matched, or the caller sent True: its client went away).
    ``text`` is the request's TextStream. With ``each_token`` (logprobs asked for) every token yields
    a piece, its text possibly empty, carrying its record."""
    from wcache.engine.core.textstream import TextPiece

    out: list[int] = []
    scores: list[Sampled] = []
    prompt_scores = None
    gone = False
    end = None
    first_at = None
    try:
        while True:
            item = get()
            if isinstance(item, _End):
                end = item
                break
            if isinstance(item, PromptScores):
                prompt_scores = item
                continue
            if not out:
                first_at = time.monotonic()
            out.append(item.id)
            if each_token:
                scores.append(item)
            piece = text.push(item.id, item.id in stop_ids)
            if each_token and not gone:
                gone = bool((yield TextPiece(piece, (item,), prompt_scores if len(out) == 1 else None)))
            elif piece and not gone:
                gone = bool((yield TextPiece(piece, (), prompt_scores if len(out) == 1 else None)))
            if text.stopped or gone:
                cancel()
                break
    except GeneratorExit:  # closed: nobody reads on
        cancel()
        raise
    if end is not None and end.reason == "error":
        raise RuntimeError(f"the engine failed: {end.error}") from end.error
    rest = text.finish()
    if rest and not gone:
        yield TextPiece(rest)
    finish = finish_reason(end, text.stopped, out, stop_ids)
    return Completion(text.text, out, finish, stop_reason(text.stop_reason, finish, out, own_stops, eos),
                      len(prompt_ids), first_at, tuple(scores), prompt_scores, tuple(prompt_ids))


def stop_sets(checkpoint_stops: frozenset[int], stop_token_ids, ignore_eos: bool):
    """(the request's own stop ids, the ids that end it, the ids min_tokens holds back), as vLLM
    reads stop_token_ids and ignore_eos: ignore_eos drops the checkpoint's EOS ids from the ends,
    and min_tokens holds back every stop id, the EOS ones too (vLLM's _all_stop_token_ids)."""
    own = frozenset(stop_token_ids)
    return own, own if ignore_eos else checkpoint_stops | own, checkpoint_stops | own


def drive(pieces, on_text=None) -> Completion:
    """Run a ``pieces()`` generator to its Completion, telling ``on_text(piece)`` each piece; its
    True stops the request (a client gone)."""
    try:
        piece = next(pieces)
        while True:
            piece = pieces.send(bool(on_text(piece)) if on_text is not None else False)
    except StopIteration as done:
        return done.value
