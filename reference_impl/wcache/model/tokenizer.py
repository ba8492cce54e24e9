"""A checkpoint's own tokenizer: its ``tokenizer.json``, read with Hugging Face ``tokenizers``.

``tokenizers`` is the Rust library transformers' fast tokenizers and vLLM run, so a prompt becomes
the ids the model was trained on, and the ids it answers become that text again. Whether encoding adds BOS is the post-processor's
in ``tokenizer.json`` (Llama's adds it, Qwen's does not), as with transformers'
``PreTrainedTokenizerFast``; ``tokenizer_config.json`` names ``bos_token`` and ``eos_token`` (a
string, or an AddedToken's ``{"content": ...}``). The stop ids are generation_config.py's.

No torch here: the engine's front, which tokenizes, will run in a process without it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer as Backend
from tokenizers.decoders import DecodeStream

from wcache.errors import NO_TOKENIZER, TOKENIZER_UNREADABLE, UserError

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"


class TokenizerError(UserError):
    pass


def special_text(config: dict, name: str) -> str | None:
    """``bos_token`` / ``eos_token`` of tokenizer_config.json: a string, or an AddedToken as
    transformers saves one (``{"content": "<s>", ...}``)."""
    v = config.get(name)
    if isinstance(v, dict):
        v = v.get("content")
    return v if isinstance(v, str) and v else None


def read_json_object(path: Path) -> dict:
    """A JSON object from ``path``, {} when there is no such file; a refusal when it is not one."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise TokenizerError(TOKENIZER_UNREADABLE.format(path=path, why=e)) from None
    if not isinstance(data, dict):
        raise TokenizerError(TOKENIZER_UNREADABLE.format(path=path, why="not a JSON object"))
    return data


@dataclass(frozen=True)
class Tokenizer:
    backend: Backend
    source: str  # the directory it came from, for the start-up log line
    bos_token: str | None = None
    eos_token: str | None = None

    @classmethod
    def load(cls, model_dir: str, tokenizer: str | None = None) -> Tokenizer:
        """The tokenizer of ``tokenizer`` (vLLM's ``--tokenizer``: a directory), else of the model
        directory; a directory without ``tokenizer.json`` is refused with both flags named."""
        d = Path(tokenizer or model_dir)
        path = d / TOKENIZER_FILE
        if not path.is_file():
            raise TokenizerError(NO_TOKENIZER.format(dir=d))
        try:
            backend = Backend.from_file(str(path))
        except Exception as e:  # tokenizers raises its own Exception subclass for a bad file
            raise TokenizerError(TOKENIZER_UNREADABLE.format(path=path, why=e)) from None
        config = read_json_object(d / TOKENIZER_CONFIG)
        return cls(backend, str(d), special_text(config, "bos_token"), special_text(config, "eos_token"))

    @property
    def eos_token_id(self) -> int | None:
        return None if self.eos_token is None else self.backend.token_to_id(self.eos_token)

    @property
    def bos_token_id(self) -> int | None:
        return None if self.bos_token is None else self.backend.token_to_id(self.bos_token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """``text``'s ids; ``add_special_tokens`` adds what the post-processor adds (BOS, as a rule).
        Special tokens written in the text (``<s>`` in a rendered chat prompt) become their ids."""
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def stream(self, skip_special_tokens: bool = True) -> Detokenizer:
        return Detokenizer(self, skip_special_tokens)


class Detokenizer:
    """Incremental decoding (``tokenizers``' DecodeStream, as vLLM's fast detokenizer): each id
    gives the text it makes final, never half a character (bytes that do not yet make a whole one
    wait), never a token twice; ``flush`` gives what the last ids left waiting, so that the pieces
    join to ``decode`` of every id."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
        self.tokenizer, self.skip = tokenizer, skip_special_tokens
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self.ids: list[int] = []
        self.text = ""

    def push(self, token: int) -> str:
        self.ids.append(token)
        piece = self._stream.step(self.tokenizer.backend, token) or ""
        self.text += piece
        return piece

    def flush(self) -> str:
        """The rest of ``decode(ids)`` past the pieces already given (an unfinished character shows
        as U+FFFD, as transformers' decode shows it)."""
        full = self.tokenizer.decode(self.ids, self.skip)
        rest = full[len(self.text):] if full.startswith(self.text) else ""
        self.text += rest
        return rest
