"""A completion's text as its tokens arrive: the pieces a stream may send, and stop strings.

The checkpoint's tokenizer decodes incrementally (model/tokenizer.py's Detokenizer): a character
whose bytes span several tokens is given once whole. A piece is sent only once it cannot change:
with stop strings the last ``len(longest stop) - 1`` characters wait too (they may be the start of
one). So the pieces always join to the final text, which is the decoding of every generated id
(but a last stop id, whose text is never shown, as vLLM) and ends before the first stop string
found (vLLM's default: the stop string is not part of the output). Without a tokenizer
(``--skip-tokenizer-init``) there is no text: every piece is empty.
"""

from __future__ import annotations

from wcache.model.tokenizer import Detokenizer


class TextPiece(str):
    """A piece of text and, when the request asked for log-probabilities, the tokens it came with
    (``tokens``: logprobs.Sampled records) and, on the first piece, the prompt's scores (``prompt``).
    A ``str``: whoever only wants the text reads it as one."""

    tokens: tuple = ()
    prompt = None

    def __new__(cls, text: str, tokens: tuple = (), prompt=None):
        piece = super().__new__(cls, text)
        piece.tokens, piece.prompt = tokens, prompt
        return piece


class TextStream:
    def __init__(self, detokenizer: Detokenizer | None, stop: list[str] | tuple[str, ...] = (),
                 include_stop: bool = False, min_tokens: int = 0):
        """``include_stop``: vLLM's include_stop_str_in_output (the stop string, or a stop id's
        text, stays in the output). ``min_tokens``: stop strings are looked for only after that
        many tokens, as vLLM does."""
        self.detok = detokenizer
        self.include_stop, self.min_tokens, self.count = include_stop, min_tokens, 0
        self.stop = [s for s in stop if s]
        self.holdback = max((len(s) for s in self.stop), default=1) - 1
        self.sent = ""  # the text handed out so far
        self.stop_reason: str | None = None  # the stop string that ended the text

    def _find_stop(self, text: str) -> str | None:
        if self.count <= self.min_tokens:
            return None
        # Text sent while min_tokens held the check off is not searched again (it cannot be taken back).
        start = len(self.sent) if self.min_tokens else 0
        hits = [(i, s) for s in self.stop if (i := text.find(s, start)) >= 0]
        if not hits:
            return None
        i, s = min(hits)
        self.stop_reason = s
        return text[:i + len(s)] if self.include_stop else text[:i]

    def push(self, token: int, is_stop_id: bool = False) -> str:
        """The new piece of text this token makes final ("" if none); check ``stopped`` after. A
        stop id (EOS) ends the completion and adds no text."""
        self.count += 1
        if self.detok is None or (is_stop_id and not self.include_stop):
            return ""
        self.detok.push(token)
        decoded = self.detok.text
        cut = self._find_stop(decoded)
        if cut is not None:
            return self._advance(cut)
        return self._advance(decoded[:max(len(self.sent), len(decoded) - self.holdback)])

    @property
    def stopped(self) -> bool:
        return self.stop_reason is not None

    def finish(self) -> str:
        """The rest of the text once no token follows (an unfinished character shown as U+FFFD)."""
        if self.stopped or self.detok is None:
            return ""
        self.detok.flush()
        text = self.detok.text
        cut = self._find_stop(text)
        return self._advance(text if cut is None else cut)

    @property
    def text(self) -> str:
        return self.sent

    def _advance(self, upto: str) -> str:
        assert upto.startswith(self.sent), (upto, self.sent)  # pieces only ever extend the text
        piece, self.sent = upto[len(self.sent):], upto
        return piece
