"""make-checkpoint's tokenizer files (core/checkpoint_tokenizer.py) and how the engine reads a
checkpoint's tokenizer and stop ids (model/tokenizer.py, model/generation_config.py): the same file
on every run, read back by transformers' own AutoTokenizer to the same ids, stop ids from
generation_config.json (one id or a list) or config.json, and the refusals' texts."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from wcache import errors
from wcache.core import checkpoint_tokenizer
from wcache.model import generation_config
from wcache.model.tokenizer import Tokenizer, TokenizerError

TEXTS = ["The weight cache keeps a model's weights in memory.", "héllo €uro 😀 東京", "<s>x</s> y", " lead  spaces"]


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    checkpoint_tokenizer.write(d, 512, 512)
    return d


def test_training_is_the_same_in_another_process(written):
    code = ("import sys; from wcache.core.checkpoint_tokenizer import train; "
            "sys.stdout.write(train(512).to_str())")
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert json.loads(other) == json.loads((written / "tokenizer.json").read_text())


def test_transformers_reads_the_files_to_the_same_ids_and_text(written):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(written)
    ours = Tokenizer.load(str(written))
    assert (ours.bos_token_id, ours.eos_token_id) == (hf.bos_token_id, hf.eos_token_id) == (0, 1)
    for text in TEXTS:
        ids = hf(text)["input_ids"]
        assert ours.encode(text) == ids and ids[0] == 0  # BOS added, as Llama's tokenizer does
        assert ours.encode(text, add_special_tokens=False) == hf(text, add_special_tokens=False)["input_ids"]
        assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True)
        assert ours.decode(ids, skip_special_tokens=False) == hf.decode(ids)


def test_tokenizer_json_post_processor_decides_bos_as_in_transformers(written, tmp_path):
    from transformers import AutoTokenizer

    for name in ("tokenizer.json", "generation_config.json"):
        (tmp_path / name).write_bytes((written / name).read_bytes())
    config = json.loads((written / "tokenizer_config.json").read_text())
    for flags in ({"add_bos_token": False}, {"add_bos_token": True, "add_eos_token": True}):
        (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, **flags}))
        want = AutoTokenizer.from_pretrained(tmp_path)("Hello")["input_ids"]
        assert Tokenizer.load(str(tmp_path)).encode("Hello") == want


def test_stop_ids_from_generation_config_one_id_or_a_list_else_config_json(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 7}))
    assert generation_config.stop_ids(str(tmp_path), 1) == {1, 7}  # no generation_config.json: config.json's
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [128001, 128008, 128009]}))
    assert generation_config.stop_ids(str(tmp_path), None) == {128001, 128008, 128009}
    assert generation_config.stop_ids(str(tmp_path), 1, "vllm") == {1}
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": "2"}))
    with pytest.raises(TokenizerError) as e:
        generation_config.stop_ids(str(tmp_path), 1)
    assert str(e.value) == errors.GENERATION_CONFIG_EOS.format(path=tmp_path / "generation_config.json", value="2")


def test_a_directory_without_tokenizer_json_names_both_flags(tmp_path):
    with pytest.raises(TokenizerError) as e:
        Tokenizer.load(str(tmp_path))
    assert str(e.value) == errors.NO_TOKENIZER.format(dir=tmp_path)
    assert "--tokenizer" in str(e.value) and "--skip-tokenizer-init" in str(e.value)


def test_the_tokenizer_flag_reads_another_directory(written, tmp_path):
    assert Tokenizer.load(str(tmp_path), str(written)).encode("Hi") == Tokenizer.load(str(written)).encode("Hi")


def test_a_broken_tokenizer_json_is_refused_with_its_path(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(TokenizerError, match="Cannot read the tokenizer file .*tokenizer.json"):
        Tokenizer.load(str(tmp_path))


def test_the_tokenizer_modules_import_no_torch():
    code = ("import sys; import wcache.model.tokenizer, wcache.model.generation_config, wcache.engine.core.textstream; "
            "sys.exit('torch' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
