"""What a request gets back from the engine, in whichever process runs the HTTP layer: the
Completion, and the end of a sequence's stream of tokens. No torch here: `wcache serve`'s front
process (engine/core_client.py) builds them from the token ids its engine core sends."""

from __future__ import annotations

from dataclasses import dataclass

# Tokens a request's thread may fall behind the engine loop (a streaming client that stops reading,
# once the socket's buffers are full) before the engine ends that request and frees its slot.
STREAM_BUFFER_TOKENS = 256


@dataclass(frozen=True)
class Completion:
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" (EOS or a stop string) or "length"
    stop_reason: str | None  # the stop string that ended it (None for EOS or length, as vLLM)
    prompt_tokens: int
    first_token_at: float | None = None  # time.monotonic() of the first token (the metrics' time to first token)


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
