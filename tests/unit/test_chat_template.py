"""The chat template (engine/openai/chat_template.py): found where transformers and vLLM look, rendered as
transformers renders it (compared with transformers' own renderer), sandboxed, and encoded by the
checkpoint's tokenizer with BOS and EOS as their ids."""

from __future__ import annotations

import json

import pytest

from wcache import errors
from wcache.core.checkpoint import make_checkpoint
from wcache.core.checkpoint_tokenizer import BOS_ID, CHAT_TEMPLATE, EOS_ID
from wcache.engine.openai import chat_template
from wcache.engine.openai.chat_template import ChatTemplate, ChatTemplateError, RenderError
from wcache.model.tokenizer import Tokenizer

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Héllo {{ x }}"},
            {"role": "assistant", "content": "Hi."}, {"role": "user", "content": "And?"}]

# Templates in the styles checkpoints ship: make-checkpoint's, Llama 3's header tokens, a Mistral-style
# alternation check with raise_exception, tojson, loop controls and whitespace trimming.
TEMPLATES = {
    "make-checkpoint": CHAT_TEMPLATE,
    "llama3-style": (
        "{{ bos_token }}{% for message in messages %}"
        "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim "
        "+ '<|eot_id|>' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"),
    "alternation": (
        "{% for message in messages %}\n"
        "  {% if message['role'] == 'system' %}{% continue %}{% endif %}\n"
        "  {% if (message['role'] == 'user') != (loop.index0 % 2 == 1) %}\n"
        "    {{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}\n"
        "  {% endif %}\n"
        "  [{{ message['role'] }}] {{ message | tojson }}\n"
        "{% endfor %}\n"
        "{% if add_generation_prompt %}[assistant]{% endif %}"),
}


@pytest.mark.parametrize("name", list(TEMPLATES))
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_renders_as_transformers_renders(name, add_generation_prompt):
    from transformers.utils.chat_template_utils import render_jinja_template

    [want], _ = render_jinja_template([MESSAGES], chat_template=TEMPLATES[name], bos_token="<s>", eos_token="</s>",
                                      add_generation_prompt=add_generation_prompt)
    assert ChatTemplate("test", TEMPLATES[name], "<s>", "</s>").render(MESSAGES, add_generation_prompt) == want


def test_make_checkpoints_template_reads_as_its_tokens(model):
    t = chat_template.load(str(model))
    text = t.render([{"role": "user", "content": "Hi"}])
    assert text == "<s><|user|>\nHi</s>\n<|assistant|>\n"
    tok = Tokenizer.load(str(model))
    ids = tok.encode(text, add_special_tokens=False)  # as apply_chat_template: the template wrote BOS
    assert ids[0] == BOS_ID and ids.count(EOS_ID) == 1 and BOS_ID not in ids[1:]
    assert tok.decode(ids) == "<|user|>\nHi\n<|assistant|>\n"  # BOS and EOS are not text
    assert tok.decode(ids, skip_special_tokens=False) == text


def test_a_template_that_refuses_raises_its_own_message():
    t = ChatTemplate("test", TEMPLATES["alternation"])
    with pytest.raises(RenderError, match="Conversation roles must alternate"):
        t.render([{"role": "system", "content": "Be brief."}, {"role": "assistant", "content": "first"}])


@pytest.mark.parametrize("attack", ["{{ ''.__class__.__mro__[1].__subclasses__() }}",
                                    "{{ messages.append(1) }}",  # immutable: a template cannot edit the request
                                    "{{ cycler.__init__.__globals__.os.system('id') }}"])
def test_the_sandbox_refuses_pythons_internals(attack):
    with pytest.raises(RenderError):
        ChatTemplate("test", attack).render(MESSAGES)


def test_strftime_now_is_there():
    assert ChatTemplate("test", "{{ strftime_now('%Y') }}").render(MESSAGES).isdigit()


def test_a_broken_template_is_refused_at_load_with_its_line():
    with pytest.raises(ChatTemplateError) as e:
        ChatTemplate("x.jinja", "{% for m in messages %}\n{{ m }")
    assert str(e.value).startswith("The chat template from x.jinja is not valid Jinja (line 2): ")


@pytest.fixture
def model(tmp_path):
    return make_checkpoint(tmp_path / "tiny", "tiny")


def test_make_checkpoint_writes_the_template_in_tokenizer_config(model):
    config = json.loads((model / "tokenizer_config.json").read_text())
    assert config["chat_template"] == CHAT_TEMPLATE and (config["bos_token"], config["eos_token"]) == ("<s>", "</s>")
    t = chat_template.load(str(model))
    assert t.source == str(model / "tokenizer_config.json") and t.text == CHAT_TEMPLATE


def test_the_jinja_file_wins_over_tokenizer_config_as_in_transformers(model):
    (model / "chat_template.jinja").write_text("jinja {{ messages[0]['content'] }}")
    assert chat_template.load(str(model)).render(MESSAGES) == "jinja Be brief."


def test_the_flag_wins_over_the_checkpoint(model, tmp_path):
    (tmp_path / "mine.jinja").write_text("mine")
    assert chat_template.load(str(model), str(tmp_path / "mine.jinja")).render(MESSAGES) == "mine"
    inline = chat_template.load(str(model), "{{ bos_token }}in\\nline")  # vLLM: template text, escapes decoded
    assert inline.source == "--chat-template (inline)" and inline.render(MESSAGES) == "<s>in\nline"


def test_a_flag_that_is_neither_a_file_nor_a_template_is_vllms_error(model):
    with pytest.raises(ChatTemplateError) as e:
        chat_template.load(str(model), "no-such.jinja")
    assert str(e.value) == errors.CHAT_TEMPLATE_FILE.format(
        value="no-such.jinja", reason="[Errno 2] No such file or directory: 'no-such.jinja'")


def test_named_templates_and_special_tokens_from_tokenizer_config(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": {"content": "<|begin_of_text|>", "lstrip": False}, "eos_token": "<|eot|>",
        "chat_template": [{"name": "tool_use", "template": "tools"},
                          {"name": "default", "template": "{{ bos_token }}x{{ eos_token }}"}]}))
    t = chat_template.load(str(tmp_path))
    assert t.render(MESSAGES) == "<|begin_of_text|>x<|eot|>"


def test_no_template_is_none(tmp_path):
    assert chat_template.load(str(tmp_path)) is None
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>"}))
    assert chat_template.load(str(tmp_path)) is None

