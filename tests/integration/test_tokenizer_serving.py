"""`wcache serve` and the checkpoint's tokenizer, as vLLM has it: a checkpoint without tokenizer.json
stops serve with one line naming --tokenizer and --skip-tokenizer-init; --tokenizer takes it from
another directory (the same answer); --skip-tokenizer-init serves token ids only (the same ids, no
text; text prompts, stop strings and chat refused with vLLM's text); a stream's pieces never hold
half a character and join to the plain answer; usage counts the model's tokens."""

from __future__ import annotations

import json
import shutil
import urllib.request

import pytest
from procs import _healthy, complete, free_port, http
from wcache import errors
from wcache.model.tokenizer import Tokenizer

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")
PROMPT = "The weight cache keeps"


@pytest.fixture(scope="module")
def bare(tiny_model, tmp_path_factory):
    """The tiny checkpoint without its tokenizer files; and a directory holding only them."""
    d = tmp_path_factory.mktemp("bare")
    model, tok = d / "model", d / "tok"
    shutil.copytree(tiny_model, model)
    tok.mkdir()
    for name in TOKENIZER_FILES:
        shutil.move(model / name, tok / name)
    return model, tok


def test_a_checkpoint_without_a_tokenizer_names_both_flags(main, bare):
    model, _ = bare
    code, out = main("serve", str(model), "--device", "cpu", "--host", "127.0.0.1", "--port", str(free_port()))
    lines = out.strip().splitlines()
    assert code == 2 and len(lines) == 1, out
    assert lines[0].endswith("] " + errors.NO_TOKENIZER.format(dir=model)), out


@pytest.fixture(scope="module")
def engines(tiny_model, bare, module_procs):
    model, tok = bare
    flags = ("--max-model-len", "64", "--no-enable-autotune")
    started = {"own": module_procs.serve(tiny_model, *flags, ready=False, name="own"),
               "flag": module_procs.serve(model, *flags, "--tokenizer", str(tok), ready=False, name="flag"),
               "ids": module_procs.serve(tiny_model, *flags, "--skip-tokenizer-init", ready=False, name="ids")}
    for p in started.values():
        p.wait_for(lambda p=p: _healthy(p.port), what="/health 200")
    return started


def test_the_tokenizer_flag_gives_the_same_answer(engines, tiny_model):
    own, flag = (complete(engines[k].port, PROMPT, 12) for k in ("own", "flag"))
    assert own["choices"] == flag["choices"] and own["choices"][0]["text"]
    assert own["usage"]["prompt_tokens"] == len(Tokenizer.load(str(tiny_model)).encode(PROMPT))
    assert own["usage"]["completion_tokens"] == len(own["choices"][0]["token_ids"])
    assert f"Tokenizer: from {tiny_model}" in engines["own"].log() and "Stop token ids: 1" in engines["own"].log()


def test_skip_tokenizer_init_serves_token_ids_only(engines, tiny_model):
    ids = Tokenizer.load(str(tiny_model)).encode(PROMPT)
    own = complete(engines["own"].port, PROMPT, 12)["choices"][0]
    bare_ids = complete(engines["ids"].port, ids, 12)["choices"][0]
    assert bare_ids["token_ids"] == own["token_ids"] and bare_ids["text"] == ""
    url = f"http://127.0.0.1:{engines['ids'].port}/v1"
    for path, body, message in [
        ("/completions", {"prompt": PROMPT}, errors.TEXT_WITHOUT_TOKENIZER),
        ("/completions", {"prompt": ids, "stop": "x"}, errors.STOP_WITHOUT_TOKENIZER),
        ("/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}, errors.TEXT_WITHOUT_TOKENIZER),
    ]:
        status, answer = http("POST", url + path, body)
        assert (status, answer["error"]["message"]) == (400, message), answer


def test_stream_pieces_are_whole_characters_and_join_to_the_answer(engines):
    port = engines["own"].port
    for prompt in ("héllo €uro", "東京"):
        whole = complete(port, prompt, 24)["choices"][0]
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", method="POST",
                                     data=json.dumps({"prompt": prompt, "max_tokens": 24, "stream": True}).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            events = [line[6:] for line in r.read().decode("utf-8").splitlines() if line.startswith("data: {")]
        pieces = [json.loads(e)["choices"][0]["text"] for e in events if json.loads(e)["choices"]]
        # A piece sent with half a character would carry a U+FFFD that the whole answer has not.
        assert "".join(pieces) == whole["text"] and len(pieces) > 2
