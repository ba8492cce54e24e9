"""``POST /v1/chat/completions`` as vLLM serves it: what a chat request may ask, how its messages
become a prompt (chat_template.py renders them), and the JSON that answers it. No sockets here.

Every field is in ``CHAT_FIELDS``, supported or refused, and docs/serve-reference.md's chat table is
generated from it; the rest is openai_api.py's (field checks, sampling, stop, stream, errors).
A message's ``content`` may be a string or a list of text parts, which are joined with newlines
before the template sees them (vLLM's "string" content format); any other part is refused.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

from wcache.engine.openai import openai_api as api
from wcache.engine.openai.chat_template import ChatTemplate, RenderError
from wcache.engine.openai.openai_api import ApiError, Field
from wcache.engine.openai import sampling_fields as fields
from wcache.engine.openai.logprob_answers import chat_logprobs
from wcache.engine.worker.sampling_params import SamplingParams
from wcache.engine.openai.sampling_fields import StopRules
from wcache.errors import (
    BOOLEAN_FIELD, CHAT_TEMPLATE_KWARGS, CHAT_TEMPLATE_RENDER, MESSAGE_CONTENT, MESSAGE_FIELD, MESSAGE_PART,
    MESSAGE_SHAPE, MESSAGES_REQUIRED, N_TOO_MANY, NO_CHAT_TEMPLATE, TEXT_WITHOUT_TOKENIZER,
)
from wcache.model.tokenizer import Tokenizer

MESSAGE_FIELDS = ("role", "content", "name")
# Names the template's own variables take: chat_template_kwargs may not replace them.
RESERVED = ("messages", "add_generation_prompt", "bos_token", "eos_token")

CHAT_FIELDS: dict[str, Field] = {
    "messages": Field(True, "a non-empty list of `{\"role\", \"content\"}` messages (and an optional `name`); "
                            "`content` is a string, `null`, or a list of `{\"type\": \"text\"}` parts"),
    "model": api.COMPLETION_FIELDS["model"],
    "max_completion_tokens": Field(True, "tokens to generate, 1 to the model length minus the prompt (default: "
                                         "all of that, as vLLM); wins over `max_tokens`"),
    "max_tokens": Field(True, "the older name of `max_completion_tokens`"),
    "temperature": api.COMPLETION_FIELDS["temperature"],
    "top_p": api.COMPLETION_FIELDS["top_p"],
    "seed": api.COMPLETION_FIELDS["seed"],
    "stop": api.COMPLETION_FIELDS["stop"],
    "stream": Field(True, "`true`: server-sent events, `chat.completion.chunk` objects whose `delta` holds "
                          "the role, then each piece of text, then `data: [DONE]`"),
    "stream_options": api.COMPLETION_FIELDS["stream_options"],
    "user": api.COMPLETION_FIELDS["user"],
    "add_generation_prompt": Field(True, "vLLM's: passed to the template (default `true`: end the prompt where "
                                         "the assistant's reply begins)"),
    "add_special_tokens": Field(True, "vLLM's: `true` encodes the rendered prompt with the tokenizer's special "
                                      "tokens added (BOS, as a rule; default `false`: the template writes its own)"),
    "chat_template_kwargs": Field(True, "vLLM's: an object of extra variables for the template (not "
                                        "`messages`, `add_generation_prompt`, `bos_token` or `eos_token`)"),
    "n": Field(True, f"choices, 1 or more (default 1, at most {api.MAX_PROMPTS}): each its own sequence in the "
                     "batch; with a `seed`, choice j is seeded `seed + j`, as vLLM"),
    "logprobs": Field(True, "`true`: each token's log-probability (`log_softmax` of the model's logits, before "
                            "any sampling setting, as vLLM)"),
    "top_logprobs": Field(True, "0 to 20, with `logprobs`: the most likely tokens' log-probabilities at each "
                                "position too, in rank order"),
    api.TOKEN_IDS: api.COMPLETION_FIELDS[api.TOKEN_IDS],
    "presence_penalty": api.COMPLETION_FIELDS["presence_penalty"],
    "frequency_penalty": api.COMPLETION_FIELDS["frequency_penalty"],
    "repetition_penalty": api.COMPLETION_FIELDS["repetition_penalty"],
    "logit_bias": api.COMPLETION_FIELDS["logit_bias"],
    "top_k": api.COMPLETION_FIELDS["top_k"],
    "min_p": api.COMPLETION_FIELDS["min_p"],
    "min_tokens": api.COMPLETION_FIELDS["min_tokens"],
    "stop_token_ids": api.COMPLETION_FIELDS["stop_token_ids"],
    "ignore_eos": api.COMPLETION_FIELDS["ignore_eos"],
    "include_stop_str_in_output": api.COMPLETION_FIELDS["include_stop_str_in_output"],
    "response_format": Field(False, "no structured output: text only", (None, {"type": "text"})),
    "tools": Field(False, "no tool calling", (None, [])),
    "tool_choice": Field(False, "no tool calling", (None, "none")),
    "parallel_tool_calls": Field(False, "no tool calling", (None,)),
    "echo": Field(False, "the prompt is not echoed", (False,)),
    "continue_final_message": Field(False, "the reply starts a new assistant message", (False,)),
    "skip_special_tokens": api.COMPLETION_FIELDS["skip_special_tokens"],
    "chat_template": Field(False, "the server's template only (`--chat-template`): a request cannot bring its own",
                           (None,)),
}


@dataclass(frozen=True)
class ChatRequest:
    prompt: list[int]  # the rendered messages' token ids
    max_tokens: int
    sampling: SamplingParams
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    skip_special_tokens: bool = True
    n: int = 1
    stop_rules: StopRules = StopRules()
    tokens_as_ids: bool = False  # return_tokens_as_token_ids

    def choice_prompts(self) -> list[list[int]]:
        return [self.prompt] * self.n

    def choice_sampling(self, index: int) -> SamplingParams:
        return self.sampling.for_choice(index)


def _text(content, index: int) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise ApiError(400, MESSAGE_CONTENT.format(index=index), "messages")
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise ApiError(400, MESSAGE_PART.format(index=index, part=j), "messages")
        texts.append(part["text"])
    return "\n".join(texts)


def parse_messages(messages) -> list[dict]:
    """The messages as the template sees them: role, content as one string, and name if given."""
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, MESSAGES_REQUIRED, "messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not m["role"]:
            raise ApiError(400, MESSAGE_SHAPE.format(index=i), "messages")
        extra = next((k for k in m if k not in MESSAGE_FIELDS), None)
        if extra is not None:
            raise ApiError(400, MESSAGE_FIELD.format(index=i, field=str(extra)[:64]), "messages")
        msg = {"role": m["role"], "content": _text(m.get("content"), i)}
        if m.get("name") is not None:
            if not isinstance(m["name"], str):
                raise ApiError(400, MESSAGE_SHAPE.format(index=i), "messages")
            msg["name"] = m["name"]
        out.append(msg)
    return out


def _bool(req: dict, field: str, default: bool) -> bool:
    v = req.get(field)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise ApiError(400, BOOLEAN_FIELD.format(field=field), field)
    return v


def _template_kwargs(req: dict) -> dict:
    kw = req.get("chat_template_kwargs")
    if kw is None:
        return {}
    if not isinstance(kw, dict) or any(k in RESERVED for k in kw):
        raise ApiError(400, CHAT_TEMPLATE_KWARGS.format(reserved=", ".join(RESERVED)), "chat_template_kwargs")
    return kw


def parse_chat_request(body: bytes, template: ChatTemplate | None, max_model_len: int, served=(),
                       has_draft: bool = False, tokenizer: Tokenizer | None = None,
                       vocab_size: int | None = None) -> ChatRequest:
    """A chat request checked as vLLM checks it: fields, then the model (404), then the template (400)."""
    req = api.parse_json_object(body)
    api.check_fields(req, CHAT_FIELDS)
    if served:
        api.check_model(req, served)
    if tokenizer is None:
        raise ApiError(400, TEXT_WITHOUT_TOKENIZER)
    if template is None:
        raise ApiError(400, NO_CHAT_TEMPLATE)
    messages = parse_messages(req.get("messages"))
    add_generation_prompt = _bool(req, "add_generation_prompt", True)
    add_special_tokens = _bool(req, "add_special_tokens", False)
    try:
        rendered = template.render(messages, add_generation_prompt, **_template_kwargs(req))
    except RenderError as e:
        raise ApiError(400, CHAT_TEMPLATE_RENDER.format(error=str(e)[:500]), "messages") from None
    ids = tokenizer.encode(rendered, add_special_tokens)  # as apply_chat_template(tokenize=True)
    if not ids:
        raise ApiError(400, CHAT_TEMPLATE_RENDER.format(error="it rendered an empty prompt"), "messages")
    api.check_prompt_fits(max_model_len, len(ids))
    field = "max_completion_tokens" if req.get("max_completion_tokens") is not None else "max_tokens"
    wanted = req.get(field)
    max_tokens = api.check_max_tokens(field, max_model_len - len(ids) if wanted is None else wanted,
                                      max_model_len, len(ids))
    try:
        n = fields.choices(req)
        if n > api.MAX_PROMPTS:
            raise fields.FieldError(N_TOO_MANY.format(n=n, prompts=1, total=n, max=api.MAX_PROMPTS), "n")
        rules = fields.stop_rules(req, vocab_size)
        sampling = api.parse_sampling(req, has_draft, vocab_size, max_tokens, fields.chat_logprobs(req, vocab_size))
        as_ids = fields.boolean(req, api.TOKEN_IDS)
    except fields.FieldError as e:
        raise ApiError(400, str(e), e.field) from None
    return ChatRequest(ids, max_tokens, sampling, api.parse_stop(req.get("stop")), *api.parse_stream(req),
                       api.parse_skip_special_tokens(req), n, rules, as_ids)


# -- answers ---------------------------------------------------------------------------------------
CHUNK = "chat.completion.chunk"


def new_id() -> str:
    return f"chatcmpl-{uuid.uuid4().hex}"


def chat_body(cid: str, model: str, completion, req: ChatRequest | None = None, tokenizer=None) -> dict:
    """A chat completion's answer; ``completion`` is one, or a list of one per choice."""
    done = completion if isinstance(completion, list) else [completion]
    k = req.sampling.logprobs if req is not None else None
    tokenizer = None if req is not None and req.tokens_as_ids else tokenizer
    return {
        "id": cid, "object": "chat.completion", "created": int(time.time()), "model": model,
        "choices": [{"index": i, "message": {"role": "assistant", "content": c.text, "tool_calls": []},
                     "logprobs": None if k is None else chat_logprobs(tokenizer, c.logprobs, k),
                     "finish_reason": c.finish_reason, "stop_reason": c.stop_reason} for i, c in enumerate(done)],
        "usage": api.total_usage(done, len(done)),  # n choices of one prompt: its tokens counted once
    }


def chunk(cid: str, created: int, model: str, delta: dict, finish_reason: str | None = None,
          stop_reason: str | int | None = None, index: int = 0, logprobs: dict | None = None) -> dict:
    """One streamed event: the first carries the role, the next ones text, the last the finish reason."""
    choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
    if finish_reason is not None:
        choice["stop_reason"] = stop_reason
    return {"id": cid, "object": CHUNK, "created": created, "model": model, "choices": [choice]}


class ChatStream:
    """A streamed chat completion's events as vLLM sends them: the role first (for each choice),
    then a ``delta`` per piece of text (with logprobs, per token, its scores with it), the finish
    reason, the usage chunk if asked, ``[DONE]``."""

    def __init__(self, model: str, include_usage: bool, req: ChatRequest | None = None, tokenizer=None):
        self.cid, self.created, self.model, self.include_usage = new_id(), int(time.time()), model, include_usage
        self.n = req.n if req is not None else 1
        self.k = req.sampling.logprobs if req is not None else None
        self.tokenizer = None if req is not None and req.tokens_as_ids else tokenizer

    def first(self) -> list:
        return [chunk(self.cid, self.created, self.model, {"role": "assistant", "content": ""}, index=i)
                for i in range(self.n)]

    def text(self, index: int, piece: str) -> list:
        logprobs = None if self.k is None else chat_logprobs(self.tokenizer, piece.tokens, self.k)
        return [chunk(self.cid, self.created, self.model, {"content": str(piece)}, index=index, logprobs=logprobs)]

    def done(self, index: int, completion) -> list:
        return [chunk(self.cid, self.created, self.model, {}, completion.finish_reason, completion.stop_reason,
                      index=index)]

    def last(self, completions: list) -> list:
        usage = ([api.usage_chunk(self.cid, self.created, self.model, completions, CHUNK, self.n)]
                 if self.include_usage else [])
        return [*usage, api.DONE]
