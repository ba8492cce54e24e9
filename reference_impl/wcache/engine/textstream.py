"""A completion's text as its tokens arrive: the pieces a stream may send, and stop strings.

The tokenizer is byte-level, so a character of several UTF-8 bytes arrives over several tokens and
``tokenizer.decode`` of a partial sequence shows the first bytes as ``\\xNN``. A piece is sent only
once it cannot change: the bytes of an unfinished character wait for the rest, and with stop strings
the last ``len(longest stop) - 1`` characters wait too (they may be the start of one). So the pieces
always join to the final text, which ends before the first stop string found (vLLM's default:
the stop string is not part of the output).
"""

from __future__ import annotations

import codecs

from wcache.model import tokenizer


def unfinished_bytes(ids: list[int]) -> int:
    """How many trailing byte tokens are the start of a UTF-8 character still incomplete."""
    tail = []
    for i in reversed(ids[-3:]):
        if i >= 256:
            break
        tail.insert(0, i)
    decoder = codecs.getincrementaldecoder("utf-8")(errors="strict")
    for start in range(len(tail)):  # the decoder keeps back exactly an incomplete character's bytes
        try:
            decoder.reset()
            decoder.decode(bytes(tail[start:]), final=False)
            return len(decoder.getstate()[0])
        except UnicodeDecodeError:
            continue
    return 0


class TextStream:
    def __init__(self, stop: list[str] | tuple[str, ...] = ()):
        self.stop = [s for s in stop if s]
        self.holdback = max((len(s) for s in self.stop), default=1) - 1
        self.ids: list[int] = []
        self.sent = ""  # the text handed out so far
        self.stop_reason: str | None = None  # the stop string that ended the text

    def _find_stop(self, text: str) -> str | None:
        hits = [(i, s) for s in self.stop if (i := text.find(s)) >= 0]
        if not hits:
            return None
        i, s = min(hits)
        self.stop_reason = s
        return text[:i]

    def push(self, token: int) -> str:
        """The new piece of text this token makes final ("" if none); check ``stopped`` after."""
        self.ids.append(token)
        ids = self.ids[:-1] if token == tokenizer.EOS_ID else self.ids
        stable = tokenizer.decode(ids[:len(ids) - unfinished_bytes(ids)])
        cut = self._find_stop(stable)
        if cut is not None:
            return self._advance(cut)
        return self._advance(stable[:max(len(self.sent), len(stable) - self.holdback)])

    @property
    def stopped(self) -> bool:
        return self.stop_reason is not None

    def finish(self) -> str:
        """The rest of the text once no token follows (incomplete characters shown as ``\\xNN``)."""
        if self.stopped:
            return ""
        text = tokenizer.decode(self.ids)
        cut = self._find_stop(text)
        return self._advance(text if cut is None else cut)

    @property
    def text(self) -> str:
        return self.sent

    def _advance(self, upto: str) -> str:
        assert upto.startswith(self.sent), (upto, self.sent)  # pieces only ever extend the text
        piece, self.sent = upto[len(self.sent):], upto
        return piece
