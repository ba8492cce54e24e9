"""The ids that end a completion, read as transformers and vLLM read them.

transformers' ``generate`` stops at ``generation_config.json``'s ``eos_token_id`` (one id or a
list; Llama 3.1 lists 128001, 128008 and 128009), and where a checkpoint has no such file, at
``config.json``'s (``GenerationConfig.from_model_config``). vLLM stops at the tokenizer's EOS and at
every id of that list too. ``--generation-config`` is vLLM's flag: ``auto`` (the model directory),
``vllm`` (no file: the tokenizer's EOS alone), or another directory to read it from.

No torch here (the engine's front reads it).
"""

from __future__ import annotations

from pathlib import Path

from wcache.errors import GENERATION_CONFIG_EOS
from wcache.model.tokenizer import TokenizerError, read_json_object

GENERATION_CONFIG = "generation_config.json"


def _ids(value, path: Path) -> tuple[int, ...]:
    if value is None:
        return ()
    values = value if isinstance(value, list) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
        raise TokenizerError(GENERATION_CONFIG_EOS.format(path=path, value=str(value)[:100]))
    return tuple(values)


def eos_token_ids(model_dir: str, generation_config: str = "auto") -> tuple[int, ...]:
    """The checkpoint's end-of-sequence ids, in the order its files list them."""
    if generation_config == "vllm":
        return ()
    d = Path(model_dir if generation_config == "auto" else generation_config)
    path = d / GENERATION_CONFIG
    if path.is_file():
        return _ids(read_json_object(path).get("eos_token_id"), path)
    path = Path(model_dir) / "config.json"
    return _ids(read_json_object(path).get("eos_token_id"), path)


def stop_ids(model_dir: str, tokenizer_eos: int | None, generation_config: str = "auto") -> frozenset[int]:
    """Every id that ends a completion: the tokenizer's EOS and the generation config's."""
    ids = set(eos_token_ids(model_dir, generation_config))
    if tokenizer_eos is not None:
        ids.add(tokenizer_eos)
    return frozenset(ids)
