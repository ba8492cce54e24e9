"""``--speculative-config``: the draft model, its method, and how many tokens it proposes.

Upstream caches MTP/EAGLE/EAGLE3 drafts in a second daemon group (the ``_draft`` sockets); a
``draft_model`` draft loads from disk. Whether a draft fits the target's layout is ranks.check_draft.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from wcache.errors import ParallelConfigError

# Methods whose draft upstream caches in a second daemon group; other drafts load from disk.
CACHED_DRAFT_METHODS = ("eagle", "eagle3", "mtp")
DRAFT_METHODS = CACHED_DRAFT_METHODS + ("draft_model",)
SPEC_KEYS = ("method", "model", "num_speculative_tokens")

SPEC_JSON = "--speculative-config is not valid JSON: {error}"
SPEC_OBJECT = "--speculative-config must be a JSON object"
SPEC_UNKNOWN = "Unknown --speculative-config key(s) {keys}; valid keys: {valid}"
SPEC_METHOD = "--speculative-config method must be one of {methods}, got {method!r}"
SPEC_MODEL = "--speculative-config needs \"model\": the draft model's directory ({error})"
SPEC_TOKENS = "--speculative-config num_speculative_tokens must be a positive integer, got {value!r}"


@dataclass(frozen=True)
class SpecConfig:
    method: str
    model: str
    num_speculative_tokens: int

    @property
    def cached(self) -> bool:
        """Upstream caches MTP/EAGLE/EAGLE3 drafts in a draft daemon group; others load from disk."""
        return self.method in CACHED_DRAFT_METHODS


def parse_speculative_config(value: str | dict | None) -> SpecConfig | None:
    if value is None or value == "":
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ParallelConfigError(SPEC_JSON.format(error=e)) from None
    if not isinstance(value, dict):
        raise ParallelConfigError(SPEC_OBJECT)
    unknown = sorted(set(value) - set(SPEC_KEYS))
    if unknown:
        raise ParallelConfigError(SPEC_UNKNOWN.format(keys=unknown, valid=list(SPEC_KEYS)))
    method = value.get("method", "draft_model")
    if method not in DRAFT_METHODS:
        raise ParallelConfigError(SPEC_METHOD.format(methods=list(DRAFT_METHODS), method=method))
    k = value.get("num_speculative_tokens")
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ParallelConfigError(SPEC_TOKENS.format(value=k))
    model = value.get("model")
    if not isinstance(model, str) or not model:
        raise ParallelConfigError(SPEC_MODEL.format(error="missing"))
    if not (Path(model) / "config.json").is_file():
        raise ParallelConfigError(SPEC_MODEL.format(error=f"no config.json in {model}"))
    return SpecConfig(method, model, k)
