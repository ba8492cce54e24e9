"""What the HTTP API serves, settled before the weights load: the names clients may ask for
(``--served-model-name``, vLLM's flag: the first is the name in every answer, any is accepted in
``model``; default the model directory as given), the tokenizer and stop ids (model/tokenizer.py,
model/generation_config.py), the chat template (chat_template.py) and the API keys (auth.py). A
missing tokenizer, or a bad template or key flag, stops ``wcache serve`` here, before minutes of
loading.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from wcache.engine.api_server import auth

from wcache.engine.openai import chat_template, template_sandbox
from wcache.engine.api_server.auth import ApiKeys
from wcache.engine.api_server.settings import ApiSettings
from wcache.engine.openai.chat_template import ChatTemplate
from wcache.errors import SERVED_NAME_EMPTY, UserError
from wcache.model import generation_config
from wcache.model.tokenizer import Tokenizer

log = logging.getLogger("wcache.server")


@dataclass(frozen=True)
class ServedModel:
    names: tuple[str, ...]
    root: str  # the model directory, as given: each model card's root
    chat_template: ChatTemplate | None = None
    api_keys: ApiKeys = field(default_factory=ApiKeys, repr=False)
    # The engine's tokenizer ("auto": the model directory's; None: --skip-tokenizer-init) and stop ids
    # (None: the checkpoint's).
    tokenizer: Tokenizer | None | str = field(default="auto", repr=False)
    stop_ids: frozenset[int] | None = None
    # What from_settings found, logged once the port is bound (a port already taken stays a one-line error).
    found: tuple[str, ...] = field(default=(), repr=False, compare=False)

    @property
    def name(self) -> str:
        return self.names[0]

    @classmethod
    def of(cls, model) -> ServedModel:
        """``model`` as it is, or a model directory served under its own name with no template or key."""
        return model if isinstance(model, ServedModel) else cls((str(model),), str(model))

    @classmethod
    def from_settings(cls, model: str, api: ApiSettings) -> ServedModel:
        """From ``wcache serve``'s model directory and API settings; logs what it found (never a key)."""
        names = tuple(api.served_model_name or (model,))
        if any(not n for n in names):
            raise UserError(SERVED_NAME_EMPTY)
        tokenizer = None if api.skip_tokenizer_init else Tokenizer.load(model, api.tokenizer)
        stop_ids = generation_config.stop_ids(model, tokenizer.eos_token_id if tokenizer else None,
                                              api.generation_config)
        # Before the template is compiled: that runs in a render worker too, under the same deadline.
        template_sandbox.RUNNER.timeout_s = api.chat_template_render_timeout
        template = None if tokenizer is None else chat_template.load(tokenizer.source, api.chat_template)
        keys = auth.from_flag_or_env(api.api_key)
        found = [f"Tokenizer: from {tokenizer.source}" if tokenizer else
                 "Tokenizer: none (--skip-tokenizer-init): prompts are token ids, completions carry no text",
                 "Stop token ids: " + (", ".join(map(str, sorted(stop_ids))) or "none"),
                 "Chat template: " + (f"from {template.source}" if template else
                                      "none (POST /v1/chat/completions answers 400; give one with --chat-template)")]
        if keys:
            found.append(f"API key required on /v1/* ({'--api-key' if api.api_key is not None else auth.ENV})")
        return cls(names, model, template, keys, tokenizer=tokenizer, stop_ids=stop_ids, found=tuple(found))

    def log_found(self) -> None:
        for line in self.found:
            log.info("%s", line)
