"""The official `openai` Python client against a real `wcache serve` (tiny preset, CPU): what an
operator's OpenAI-compatible client sees, completions, streaming, sampling, the model list, and
every refusal as the client's own exception class with vLLM's status and message."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest
from prompt_ids import preset_encode

from wcache.core.checkpoint import make_checkpoint

MAX_MODEL_LEN = 64


@pytest.fixture(scope="module")
def plain_model(tmp_path_factory) -> Path:
    """The tiny preset without make-checkpoint's tokenizer_config.json: a checkpoint with no chat template."""
    model = make_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny", "tiny")
    (model / "tokenizer_config.json").unlink()
    return model


@pytest.fixture(scope="module")
def engine(module_procs, plain_model):
    return module_procs.serve(plain_model, "--max-model-len", str(MAX_MODEL_LEN), "--no-enable-autotune")


@pytest.fixture(scope="module")
def client(engine):
    # max_retries=0: a refusal must arrive as it is, not be retried
    return openai.OpenAI(base_url=f"http://127.0.0.1:{engine.port}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def model(plain_model) -> str:
    return str(plain_model)


@pytest.fixture(scope="module")
def greedy(client, model):
    """The greedy completion every other answer is compared with (no sampling field sent)."""
    return client.completions.create(model=model, prompt="Hello", max_tokens=24)


def streamed(client, **kw) -> tuple[str, list]:
    chunks = list(client.completions.create(stream=True, **kw))
    return "".join(c.choices[0].text for c in chunks if c.choices), chunks


def test_completion(greedy, model):
    [choice] = greedy.choices
    assert greedy.object == "text_completion" and greedy.model == model and greedy.id.startswith("cmpl-")
    assert choice.finish_reason in ("length", "stop") and isinstance(choice.text, str) and choice.text
    assert greedy.usage.prompt_tokens == len(preset_encode("Hello")) == 4  # BOS, H, el, lo
    assert greedy.usage.completion_tokens == len(choice.token_ids)


def test_temperature_0_is_the_greedy_output(client, model, greedy):
    again = client.completions.create(model=model, prompt="Hello", max_tokens=24, temperature=0)
    assert again.choices[0].text == greedy.choices[0].text
    assert again.choices[0].token_ids == greedy.choices[0].token_ids


def test_stream_chunks_join_to_the_completion(client, model, greedy):
    text, chunks = streamed(client, model=model, prompt="Hello", max_tokens=24)
    assert text == greedy.choices[0].text
    assert len(chunks) >= 3  # a chunk per piece of text, not one body
    assert all(c.object == "text_completion" and c.id == chunks[0].id for c in chunks)
    assert [c.choices[0].finish_reason for c in chunks[:-1]] == [None] * (len(chunks) - 1)
    assert chunks[-1].choices[0].finish_reason == greedy.choices[0].finish_reason


def test_stream_usage_comes_last_when_asked(client, model, greedy):
    text, chunks = streamed(client, model=model, prompt="Hello", max_tokens=24,
                            stream_options={"include_usage": True})
    assert text == greedy.choices[0].text
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == greedy.usage.total_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_seeded_sampling_is_reproducible_and_differs_from_greedy(client, model, greedy):
    kw = dict(model=model, prompt="Hello", max_tokens=24, temperature=1.5)
    a = client.completions.create(seed=7, **kw).choices[0]
    b = client.completions.create(seed=7, **kw).choices[0]
    assert a.token_ids == b.token_ids
    others = {tuple(client.completions.create(seed=s, **kw).choices[0].token_ids) for s in (8, 9, 10)}
    assert others | {tuple(a.token_ids)} != {tuple(greedy.choices[0].token_ids)} and len(others | {tuple(a.token_ids)}) > 1
    text, _ = streamed(client, seed=7, **kw)  # the stream draws the same tokens
    assert text == a.text


def test_a_tiny_top_p_keeps_only_the_top_token(client, model, greedy):
    c = client.completions.create(model=model, prompt="Hello", max_tokens=24, temperature=1.5, top_p=1e-9, seed=3)
    assert c.choices[0].token_ids == greedy.choices[0].token_ids


def test_stop_ends_the_text_before_the_stop_string(client, model, greedy):
    text = greedy.choices[0].text
    stop = text[4:6]
    want = text[:text.find(stop)]
    c = client.completions.create(model=model, prompt="Hello", max_tokens=24, stop=[stop, "never-seen"])
    assert (c.choices[0].text, c.choices[0].finish_reason) == (want, "stop")
    assert c.model_extra is not None and c.choices[0].model_extra["stop_reason"] == stop
    assert streamed(client, model=model, prompt="Hello", max_tokens=24, stop=stop)[0] == want


def test_models_list(client, model):
    [card] = client.models.list().data
    assert card.id == model and card.object == "model" and card.owned_by == "wcache"
    assert card.model_extra["max_model_len"] == MAX_MODEL_LEN


REFUSED = {  # name: (keyword arguments, the field the message names)
    "best_of=2": (dict(best_of=2), "'best_of' is not supported"),
    "suffix": (dict(suffix="x"), "'suffix' is not supported"),
    "unknown field": (dict(extra_body={"guided_regex": "a"}), "Unknown field 'guided_regex'"),
    # vLLM's sampling parameters out of range: vLLM's own texts (errors.py)
    "n=0": (dict(n=0), "n must be at least 1, got 0."),
    "n too many": (dict(n=65), "'n' of 65 for 1 prompt(s) asks for 65 choices; wcache serve makes at most 64"),
    "logprobs=21": (dict(logprobs=21), "Requested sample logprobs of 21, which is greater than max allowed: 20"),
    "logprobs<0": (dict(logprobs=-1), "`logprobs` must be a positive value."),
    "presence_penalty=3": (dict(presence_penalty=3), "presence_penalty must be in [-2, 2], got 3.0."),
    "frequency_penalty=-3": (dict(frequency_penalty=-3), "frequency_penalty must be in [-2, 2], got -3.0."),
    "repetition_penalty=0": (dict(extra_body={"repetition_penalty": 0}),
                             "repetition_penalty must be greater than zero, got 0.0."),
    "top_k=-2": (dict(extra_body={"top_k": -2}), "top_k must be 0 (disable), or at least 1, got -2."),
    "top_k a float": (dict(extra_body={"top_k": 1.5}), "'top_k' must be an integer, got 1.5"),
    "min_p=2": (dict(extra_body={"min_p": 2}), "min_p must be in [0, 1], got 2.0."),
    "min_p a string": (dict(extra_body={"min_p": "x"}), "'min_p' must be a number, got \"x\""),
    "min_tokens<0": (dict(extra_body={"min_tokens": -1}), "min_tokens must be greater than or equal to 0, got -1."),
    "min_tokens>max": (dict(extra_body={"min_tokens": 5}), "min_tokens must be less than or equal to max_tokens=4, got 5."),
    "logit_bias key": (dict(logit_bias={"x": 1}), "Found token_id `x` in logit_bias but token_id must be an integer"),
    "logit_bias vocab": (dict(logit_bias={"99999": 1}), "token_id(s) [99999] in logit_bias contain out-of-vocab"),
    "stop_token_ids vocab": (dict(extra_body={"stop_token_ids": [99999]}), "Token id 99999 is out of vocabulary"),
    "ignore_eos a string": (dict(extra_body={"ignore_eos": "yes"}), "'ignore_eos' must be true or false"),
    "prompt_logprobs streamed": (dict(stream=True, extra_body={"prompt_logprobs": 1}),
                                 "`prompt_logprobs` are not available when `stream=True`."),
    "prompt_logprobs=21": (dict(extra_body={"prompt_logprobs": 21}),
                           "Requested prompt logprobs of 21, which is greater than max allowed: 20"),
    "temperature < 0": (dict(temperature=-1), "'temperature' must be a number from 0 to 2, got -1"),
    "top_p > 1": (dict(top_p=1.5), "'top_p' must be a number in (0, 1], got 1.5"),
    "seed < 0": (dict(seed=-1), "'seed' must be an integer"),
    "stop of 5": (dict(stop=["a", "b", "c", "d", "e"]), "'stop' must be a string or a list of at most 4"),
    "max_tokens too many": (dict(max_tokens=MAX_MODEL_LEN), f"'max_tokens' must be between 1 and {MAX_MODEL_LEN - 4}"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_refusals_are_bad_request_errors_naming_the_field(client, model, case):
    kw, message = REFUSED[case]
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model, prompt="Hello", **{"max_tokens": 4, **kw})
    assert e.value.status_code == 400 and message in e.value.body["message"], e.value.body
    assert e.value.body["type"] == "BadRequestError" and e.value.body["code"] == 400


def test_an_unknown_model_is_not_found_with_vllms_message(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="other", prompt="Hello", max_tokens=4)
    assert e.value.status_code == 404
    assert e.value.body == {"message": "The model `other` does not exist.", "type": "NotFoundError",
                            "param": "model", "code": 404}


def test_lists_of_prompts_and_token_ids_as_vllm_takes_them(client, model, greedy):
    ids = preset_encode("Hello")  # the tokens "Hello" is, in the checkpoint's tokenizer.json
    for prompt in (ids, [ids]):
        c = client.completions.create(model=model, prompt=prompt, max_tokens=24)
        assert [ch.text for ch in c.choices] == [greedy.choices[0].text] and c.usage == greedy.usage
    many = client.completions.create(model=model, prompt=["Hello", "Hi", ids], max_tokens=24)
    assert [ch.index for ch in many.choices] == [0, 1, 2]
    assert many.choices[0].text == many.choices[2].text == greedy.choices[0].text
    assert many.choices[1].text != greedy.choices[0].text
    hi = client.completions.create(model=model, prompt="Hi", max_tokens=24)
    assert many.choices[1].text == hi.choices[0].text
    assert many.usage.prompt_tokens == 4 + 3 + 4 and many.usage.completion_tokens == sum(
        len(ch.token_ids) for ch in many.choices)
    chunks = list(client.completions.create(model=model, prompt=["Hello", "Hi"], max_tokens=24, stream=True))
    by_index = {i: "".join(c.choices[0].text for c in chunks if c.choices and c.choices[0].index == i) for i in (0, 1)}
    assert by_index == {0: greedy.choices[0].text, 1: hi.choices[0].text}
    assert sorted(c.choices[0].index for c in chunks if c.choices[0].finish_reason) == [0, 1]


@pytest.mark.parametrize("prompt,message", [
    ([256, 512], "Token id 512 is out of vocabulary"),
    ([], "'prompt' is required and must be a non-empty string"),
    (["Hello", ""], "'prompt' is required"),
    ([["x"]], "'prompt' is required"),
    (["x"] * 65, "'prompt' lists 65 prompts; wcache serve takes at most 64 in one request"),
])
def test_bad_prompt_lists_are_refused(client, model, prompt, message):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model, prompt=prompt, max_tokens=2)
    assert message in e.value.body["message"]


def test_chat_is_refused_as_vllm_refuses_a_model_without_a_chat_template(client, model):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hello"}])
    assert e.value.status_code == 400
    assert e.value.body["message"].startswith("As of transformers v4.44, default chat template is no longer allowed")
    assert "--chat-template" in e.value.body["message"]  # and says how to give one
    with pytest.raises(openai.NotFoundError):  # the model is checked first, as vLLM does
        client.chat.completions.create(model="other", messages=[{"role": "user", "content": "Hello"}])
