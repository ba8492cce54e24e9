"""Chat, served names and the API key through the official `openai` client, against a real
`wcache serve` (tiny preset, CPU) whose checkpoint carries make-checkpoint's chat template: what a
vLLM user's chat client sees, streaming included, and every refusal as the client's own exception."""

from __future__ import annotations

import json
import urllib.request

import openai
import pytest
from procs import _healthy, free_port, http

from wcache import errors
from wcache.engine.openai import chat_template
from wcache.model.tokenizer import Tokenizer

MAX_MODEL_LEN = 96
NAMES = ("tiny-chat", "tiny-alias")
KEY = "sk-wcache-test-7f3a9c2e51"  # given by VLLM_API_KEY: never on the command line
HELLO = [{"role": "user", "content": "Hello"}]


@pytest.fixture(scope="module")
def engine(module_procs, tiny_model):
    port = free_port()
    p = module_procs.start("--log-level", "DEBUG", "serve", str(tiny_model), "--device", "cpu", "--host", "127.0.0.1",
                           "--port", str(port), "--max-model-len", str(MAX_MODEL_LEN), "--no-enable-autotune",
                           "--served-model-name", *NAMES, name="serve-chat", env={"VLLM_API_KEY": KEY})
    p.port = port
    return p.wait_for(lambda: _healthy(port), what="/health 200")


@pytest.fixture(scope="module")
def client(engine):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{engine.port}/v1", api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def greedy(client):
    return client.chat.completions.create(model=NAMES[0], messages=HELLO, max_tokens=24)


def streamed(client, **kw) -> tuple[str, list]:
    chunks = list(client.chat.completions.create(stream=True, **kw))
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices), chunks


def rendered_ids(model) -> list[int]:
    """HELLO through the checkpoint's template, encoded by its tokenizer (BOS and EOS as their ids)."""
    return Tokenizer.load(str(model)).encode(chat_template.load(str(model)).render(HELLO), add_special_tokens=False)


def test_chat_completion_has_vllms_fields(greedy, tiny_model):
    [choice] = greedy.choices
    assert greedy.id.startswith("chatcmpl-") and greedy.object == "chat.completion" and greedy.model == NAMES[0]
    assert choice.index == 0 and choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert choice.finish_reason in ("length", "stop") and choice.message.content
    # The prompt is make-checkpoint's template rendered: BOS, "<|user|>\nHello", EOS, "\n<|assistant|>\n"
    assert greedy.usage.prompt_tokens == len(rendered_ids(tiny_model)) == 25
    assert greedy.usage.total_tokens == greedy.usage.prompt_tokens + greedy.usage.completion_tokens


def test_the_prompt_is_the_rendered_template(client, greedy, tiny_model):
    """The same tokens through /v1/completions with the rendered template as token ids: the same text."""
    c = client.completions.create(model=NAMES[0], prompt=rendered_ids(tiny_model), max_tokens=24)
    assert c.choices[0].text == greedy.choices[0].message.content


def test_stream_deltas_join_to_the_completion(client, greedy):
    text, chunks = streamed(client, model=NAMES[0], messages=HELLO, max_tokens=24,
                            stream_options={"include_usage": True})
    assert text == greedy.choices[0].message.content
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant" and len(chunks) >= 4
    assert chunks[-2].choices[0].finish_reason == greedy.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == greedy.usage.total_tokens


def test_max_completion_tokens_seed_and_stop(client, greedy):
    short = client.chat.completions.create(model=NAMES[1], messages=HELLO, max_completion_tokens=3)
    assert short.usage.completion_tokens == 3 and short.choices[0].finish_reason == "length"
    assert short.model == NAMES[0]  # any served name is accepted; answers carry the first
    kw = dict(model=NAMES[0], messages=HELLO, max_tokens=24, temperature=1.5)
    a = client.chat.completions.create(seed=7, **kw).choices[0].message.content
    assert client.chat.completions.create(seed=7, **kw).choices[0].message.content == a
    assert streamed(client, seed=7, **kw)[0] == a
    text = greedy.choices[0].message.content
    stop = text[4:6]
    c = client.chat.completions.create(model=NAMES[0], messages=HELLO, max_tokens=24, stop=[stop])
    assert (c.choices[0].message.content, c.choices[0].finish_reason) == (text[:text.find(stop)], "stop")


def test_text_parts_are_joined_as_vllm_joins_them(client):
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hel"}, {"type": "text", "text": "lo"}]}]
    joined = [{"role": "user", "content": "Hel\nlo"}]
    a = client.chat.completions.create(model=NAMES[0], messages=parts, max_tokens=8)
    b = client.chat.completions.create(model=NAMES[0], messages=joined, max_tokens=8)
    assert a.choices[0].message.content == b.choices[0].message.content and a.usage == b.usage


REFUSED = {  # name: (keyword arguments, what the message says)
    "n=0": (dict(n=0), "n must be at least 1, got 0."),
    "top_logprobs without logprobs": (dict(top_logprobs=2), "when using `top_logprobs`, `logprobs` must be set to true."),
    "top_logprobs=21": (dict(logprobs=True, top_logprobs=21),
                        "Requested sample logprobs of 21, which is greater than max allowed: 20"),
    "top_logprobs<0": (dict(logprobs=True, top_logprobs=-2), "`top_logprobs` must be a positive value or -1."),
    "presence_penalty=3": (dict(presence_penalty=3), "presence_penalty must be in [-2, 2], got 3.0."),
    "tools": (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}]),
              "'tools' is not supported by wcache serve: no tool calling"),
    "unknown field": (dict(extra_body={"guided_regex": "a"}), "Unknown field 'guided_regex'"),
    "request template": (dict(extra_body={"chat_template": "{{ 1 }}"}), "'chat_template' is not supported"),
    "image part": (dict(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
                   "'messages[0].content[0]' is not a text part"),
    "no messages": (dict(messages=[]), "'messages' is required"),
    "no role": (dict(messages=[{"content": "x"}]), "'messages[0]' must be an object with a non-empty string 'role'"),
    "content a number": (dict(messages=[{"role": "user", "content": 5}]), "'messages[0].content' must be a string"),
    "tool message": (dict(messages=[{"role": "tool", "content": "x", "tool_call_id": "1"}]),
                     "Unknown field 'messages[0].tool_call_id'"),
    "too many tokens": (dict(max_tokens=MAX_MODEL_LEN), f"'max_tokens' must be between 1 and {MAX_MODEL_LEN - 25}"),
    "max_completion_tokens": (dict(max_completion_tokens=0),
                              f"'max_completion_tokens' must be between 1 and {MAX_MODEL_LEN - 25}"),
    "prompt too long": (dict(messages=[{"role": "user", "content": "x" * MAX_MODEL_LEN}]),
                        f"This model's maximum context length is {MAX_MODEL_LEN} tokens. However, your request has "
                        "118 input tokens."),  # 96 x, merged in pairs, and the template's 70
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_refusals_are_bad_request_errors(client, case):
    kw, message = REFUSED[case]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(**{"model": NAMES[0], "messages": HELLO, "max_tokens": 4, **kw})
    assert e.value.status_code == 400 and message in e.value.body["message"], e.value.body


def test_an_unknown_model_is_not_found(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="other", messages=HELLO)
    assert e.value.body["message"] == "The model `other` does not exist."


def test_models_lists_every_served_name_and_retrieves_each(client, tiny_model):
    cards = client.models.list().data
    assert [c.id for c in cards] == list(NAMES)
    assert all(c.model_extra["root"] == str(tiny_model) and c.model_extra["max_model_len"] == MAX_MODEL_LEN
               for c in cards)
    assert client.models.retrieve(NAMES[1]).id == NAMES[1]
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("nope")
    assert e.value.body["message"] == "The model `nope` does not exist."


# -- the API key -----------------------------------------------------------------------------------
def _raw(engine, method: str, path: str, headers: dict, body: dict | None = None) -> tuple[int, dict]:
    req = urllib.request.Request(f"http://127.0.0.1:{engine.port}{path}", method=method, headers=headers,
                                 data=None if body is None else json.dumps(body).encode())
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.mark.parametrize("headers,message", [
    ({}, "Unauthorized: this server needs an API key, sent as 'Authorization: Bearer KEY'"),
    ({"Authorization": "Bearer wrong"}, "Unauthorized: the API key sent is not one this server accepts"),
    ({"Authorization": KEY}, "Unauthorized: this server needs an API key, sent as 'Authorization: Bearer KEY'"),
])
@pytest.mark.parametrize("method,path", [("GET", "/v1/models"), ("GET", "/v1/models/tiny-chat"),
                                         ("POST", "/v1/chat/completions"), ("POST", "/v1/completions"),
                                         ("POST", "/v1/embeddings")])
def test_v1_without_the_right_key_is_401(engine, headers, message, method, path):
    body = {"messages": HELLO, "prompt": "x", "max_tokens": 1} if method == "POST" else None
    status, answer = _raw(engine, method, path, headers, body)
    assert status == 401 and answer == {"error": {"message": message, "type": "UnauthorizedError", "param": None,
                                                  "code": 401}}


def test_the_right_key_is_served_and_health_stays_open(engine):
    assert _raw(engine, "GET", "/v1/models", {"Authorization": "Bearer " + KEY})[0] == 200
    assert _raw(engine, "GET", "/health", {}) == (200, {"status": "ok"})


def test_the_client_with_a_wrong_key_gets_its_authentication_error(engine):
    wrong = openai.OpenAI(base_url=f"http://127.0.0.1:{engine.port}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as e:
        wrong.chat.completions.create(model=NAMES[0], messages=HELLO, max_tokens=2)
    assert e.value.status_code == 401


def test_the_key_is_never_logged_nor_in_ps(engine, client):
    client.chat.completions.create(model=NAMES[0], messages=HELLO, max_tokens=2)  # a served request, logged
    _raw(engine, "GET", "/v1/models", {"Authorization": "Bearer " + KEY + "-almost"})  # a refused one
    log = engine.log()
    assert "API key required on /v1/* (VLLM_API_KEY)" in log and "GET /v1/models" in log  # DEBUG access lines
    assert KEY not in log
    cmdline = open(f"/proc/{engine.pid}/cmdline", "rb").read().decode()
    assert "tiny-chat" in cmdline and KEY not in cmdline


def test_the_flag_wins_over_the_variable_and_a_template_flag_over_the_checkpoints(procs, tiny_model, tmp_path):
    """--api-key and --chat-template (a file) on another engine, with VLLM_API_KEY set too."""
    (tmp_path / "t.jinja").write_text("{% if extra == 'boom' %}{{ raise_exception('boom: ' + extra) }}{% endif %}"
                                      "{{ bos_token }}{{ extra | default('') }}"
                                      "{% for m in messages %}{{ m['content'] }}{% endfor %}")
    e = procs.serve(tiny_model, "--max-model-len", "32", "--no-enable-autotune", "--api-key", "flag-key",
                    "--chat-template", str(tmp_path / "t.jinja"), env={"VLLM_API_KEY": "env-key"}, ready=True)
    c = openai.OpenAI(base_url=f"http://127.0.0.1:{e.port}/v1", api_key="flag-key", max_retries=0, timeout=60)
    done = c.chat.completions.create(model=str(tiny_model), messages=HELLO, max_tokens=2)
    assert done.usage.prompt_tokens == 4  # BOS + "Hello" (3 tokens): this template, not the checkpoint's
    assert f"Chat template: from {tmp_path / 't.jinja'}" in e.log()
    extra = c.chat.completions.create(model=str(tiny_model), messages=HELLO, max_tokens=2,
                                      extra_body={"chat_template_kwargs": {"extra": "abc"}})
    assert extra.usage.prompt_tokens == 7  # the template's own variable, from the request ("abc", 3 tokens)
    with pytest.raises(openai.BadRequestError) as bad:
        c.chat.completions.create(model=str(tiny_model), messages=HELLO, extra_body={"chat_template_kwargs": {
            "messages": []}})
    assert bad.value.body["message"].startswith("'chat_template_kwargs' must be an object whose keys are not")
    with pytest.raises(openai.BadRequestError) as bad:
        c.chat.completions.create(model=str(tiny_model), messages=HELLO, extra_body={"chat_template_kwargs": {
            "extra": "boom"}})
    assert bad.value.body["message"] == "The chat template could not render these messages: boom: boom"
    env_client = openai.OpenAI(base_url=f"http://127.0.0.1:{e.port}/v1", api_key="env-key", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        env_client.models.list()


@pytest.mark.parametrize("flags,message", [
    (["--api-key", ""], errors.API_KEY_EMPTY),
    (["--chat-template", "no-such.jinja"], errors.CHAT_TEMPLATE_FILE.format(
        value="no-such.jinja", reason="[Errno 2] No such file or directory: 'no-such.jinja'")),
    (["--chat-template", "{% for %}"], "The chat template from --chat-template (inline) is not valid Jinja (line 1): "),
])
def test_bad_api_flags_stop_serve_before_loading(procs, tiny_model, flags, message):
    p = procs.serve(tiny_model, *flags, ready=False)
    assert p.exit_code() == 2
    assert message in p.log() and "Loaded" not in p.log()
