"""The subset of the OpenAI API that vLLM serves, as vLLM serves it: what a request may ask, and
the JSON that answers it. No sockets here (server.py routes, http_front.py guards the door).

Every field a completion request may carry is in ``COMPLETION_FIELDS``, supported or refused, and
docs/serve-reference.md's table is generated from it (tools/doc_tables.py). A field outside it,
or a refused field with anything but its neutral value, is a 400 that names the field: a request is
never served with a setting silently dropped. Errors have vLLM's shape,
``{"error": {"message", "type", "param", "code"}}``, with vLLM's texts where vLLM has one.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from http import HTTPStatus

from wcache.engine.openai import sampling_fields as fields
from wcache.engine.openai.logprob_answers import CompletionLogprobs, prompt_logprobs
from wcache.engine.worker.sampling_params import SamplingParams
from wcache.engine.openai.sampling_fields import StopRules
from wcache.errors import (  # the texts live with every other user-facing text
    MODEL_NOT_FOUND, NO_CHAT_TEMPLATE, NOT_JSON, NOT_AN_OBJECT, UNKNOWN_FIELD, REFUSED_FIELD, PROMPT_REQUIRED,
    PROMPT_SURROGATE, MAX_TOKENS_TYPE, MAX_TOKENS_RANGE, MODEL_TYPE, TEMPERATURE, TOP_P, SEED, STOP, STREAM,
    STREAM_OPTIONS, SAMPLING_WITH_DRAFT, PROMPT_TOO_LONG, TOKEN_OUT_OF_VOCAB, PROMPT_LIST_TOO_LONG,
    CHAT_TEMPLATE_RENDER, BOOLEAN_FIELD, TEXT_WITHOUT_TOKENIZER, STOP_WITHOUT_TOKENIZER, N_TOO_MANY,
)
from wcache.model.tokenizer import Tokenizer

DEFAULT_MAX_TOKENS = 16
TOKEN_IDS = "return_tokens_as_token_ids"  # vLLM's default for /v1/completions
# Prompts in one request's list: each is decoded on its own thread (the engine batches them), so
# the list is bounded like the connections are (http_front.Limits.max_connections).
MAX_PROMPTS = 64


@dataclass(frozen=True)
class Field:
    supported: bool
    what: str  # the value it takes (supported), or why it is refused
    neutral: tuple = ()  # refused fields: values that ask for nothing, accepted (a client's explicit default)


COMPLETION_FIELDS: dict[str, Field] = {
    "model": Field(True, "one of the served names, as `GET /v1/models` lists them (optional; another name is a 404)"),
    "prompt": Field(True, "a non-empty string (encoded by the checkpoint's tokenizer, its special tokens such as "
                          "BOS added), a list of token ids (used as they are), or a list of up to "
                          f"{MAX_PROMPTS} of either: one choice per prompt, its `index` the prompt's place"),
    "max_tokens": Field(True, f"tokens to generate, 1 to the model length minus the prompt (default {DEFAULT_MAX_TOKENS})"),
    "temperature": Field(True, "0 to 2; 0 (the default here; vLLM's is 1) is greedy"),
    "top_p": Field(True, "in (0, 1], default 1: sample from the smallest set of tokens that reaches this probability"),
    "seed": Field(True, "an integer: the same seed, prompt and settings give the same completion"),
    "stop": Field(True, "a string or up to 4 strings; the text ends before the first one found (not included)"),
    "stream": Field(True, "`true`: server-sent events, one `data:` chunk per piece of text, then `data: [DONE]`"),
    "stream_options": Field(True, "`{\"include_usage\": true}` adds a last chunk with the token counts"),
    "user": Field(True, "an end-user id; accepted and not used, as vLLM"),
    "skip_special_tokens": Field(True, "vLLM's: `true` (the default) leaves the tokenizer's special tokens out of "
                                       "the text"),
    "n": Field(True, "choices per prompt, 1 or more (default 1), at most "
                     f"{MAX_PROMPTS} choices in all: each its own sequence in the batch, choice `j` of a prompt "
                     "at `index` prompt × n + j; with a `seed`, choice j is seeded `seed + j`, as vLLM"),
    "logprobs": Field(True, "0 to 20: each token's log-probability, and the `logprobs` most likely tokens' "
                            "(`log_softmax` of the model's logits, before any sampling setting, as vLLM)"),
    "echo": Field(True, "`true`: the prompt's text comes first (with `logprobs`, its tokens scored too, the "
                        "first one `null`)"),
    "prompt_logprobs": Field(True, "vLLM's: 0 to 20, not streamed: a choice's `prompt_logprobs`, `null` for the "
                                   "first prompt token, then `{id: {logprob, rank, decoded_token}}` for each"),
    "presence_penalty": Field(True, "-2 to 2 (default 0): subtracted from the logit of every token already in the "
                                    "output"),
    "frequency_penalty": Field(True, "-2 to 2 (default 0): subtracted from a token's logit once per time it is "
                                     "in the output"),
    "repetition_penalty": Field(True, "vLLM's: above 0 (default 1): the logit of a token already in the prompt or "
                                      "output divided by it if positive, multiplied by it if not"),
    "logit_bias": Field(True, "an object of token id to bias, each clamped to [-100, 100] and added to that "
                              "token's logit"),
    "top_k": Field(True, "vLLM's: 0 (the default; -1 too) or at least 1: draw from the k most likely tokens"),
    "min_p": Field(True, "vLLM's: 0 to 1 (default 0): drop tokens less likely than min_p times the most "
                         "likely one"),
    "min_tokens": Field(True, "vLLM's: 0 to `max_tokens` (default 0): no stop id or stop string ends the "
                              "completion sooner"),
    "stop_token_ids": Field(True, "vLLM's: token ids that end the completion too (`stop_reason` is the id)"),
    "ignore_eos": Field(True, "vLLM's: `true`: the checkpoint's EOS ids do not end the completion (a fixed "
                              "length, as load generators send)"),
    "include_stop_str_in_output": Field(True, "vLLM's: `true`: the stop string, or a stop id's text, stays "
                                              "in the text"),
    "return_tokens_as_token_ids": Field(True, "vLLM's: `true`: the logprobs name each token `token_id:N`, not by "
                                              "its text (byte pieces of one character decode alike)"),
    "best_of": Field(False, "one completion per request", (None, 1)),
    "suffix": Field(False, "no insertion after a suffix", (None,)),
}


class ApiError(Exception):
    """A refusal with vLLM's error shape: status, message, type, and the field it is about."""

    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param

    def body(self) -> dict:
        return error_body(self.status, self.message, self.param)


def error_type(status: int) -> str:
    """vLLM's ``type``: the status's name as an exception class (BadRequestError, NotFoundError)."""
    return HTTPStatus(status).phrase.replace(" ", "").replace("-", "") + "Error"


def error_body(status: int, message: str, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": error_type(status), "param": param, "code": status}}


@dataclass(frozen=True)
class CompletionRequest:
    prompts: tuple[list[int], ...]  # token ids, one list per choice
    max_tokens: int
    sampling: SamplingParams
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    skip_special_tokens: bool = True
    n: int = 1
    stop_rules: StopRules = StopRules()
    echo: bool = False
    echo_texts: tuple[str, ...] = ()  # each prompt's text, for echo (token ids decoded)
    prompt_logprobs: int | None = None  # the prompt_logprobs field (echo's scores are the sampling's)
    tokens_as_ids: bool = False  # return_tokens_as_token_ids

    def choice_prompts(self) -> list[list[int]]:
        """The sequences to run: each prompt n times, choice j of prompt i at index i * n + j."""
        return [p for p in self.prompts for _ in range(self.n)]

    def choice_sampling(self, index: int) -> SamplingParams:
        return self.sampling.for_choice(index % self.n)


def parse_json_object(body: bytes) -> dict:
    try:
        req = json.loads(body)
    except (ValueError, RecursionError) as e:  # bad UTF-8 or JSON, an int past the digit limit, deep nesting
        raise ApiError(400, NOT_JSON.format(error=str(e)[:200] or type(e).__name__)) from None
    if not isinstance(req, dict):
        raise ApiError(400, NOT_AN_OBJECT)
    return req


def check_model(req: dict, served) -> None:
    """``model``, when given, must be one of the served names (a string or a sequence of them)."""
    model = req.get("model")
    if model is None:
        return
    if not isinstance(model, str):
        raise ApiError(400, MODEL_TYPE, "model")
    if model not in ((served,) if isinstance(served, str) else served):
        raise ApiError(404, MODEL_NOT_FOUND.format(model=model[:256]), "model")


def check_fields(req: dict, table: dict[str, Field]) -> None:
    """Every field is in ``table``; a refused one carries only a neutral value."""
    for name, value in req.items():
        spec = table.get(name)
        if spec is None:
            raise ApiError(400, UNKNOWN_FIELD.format(field=name[:64]), name[:64])
        if not spec.supported and not any(value == n and type(value) is type(n) for n in spec.neutral):
            raise ApiError(400, REFUSED_FIELD.format(field=name, why=spec.what), name)


def _number(v) -> bool:
    return fields.finite_number(v)


def parse_completion_request(body: bytes, max_model_len: int, served=(), has_draft: bool = False,
                             vocab_size: int | None = None, tokenizer: Tokenizer | None = None) -> CompletionRequest:
    req = parse_json_object(body)
    check_fields(req, COMPLETION_FIELDS)
    if served:
        check_model(req, served)
    prompts = parse_prompts(req.get("prompt"), vocab_size, tokenizer)
    max_tokens = req.get("max_tokens", DEFAULT_MAX_TOKENS)
    if max_tokens is None:
        max_tokens = DEFAULT_MAX_TOKENS
    max_tokens = check_max_tokens("max_tokens", max_tokens, max_model_len, max(len(p) for p in prompts))
    stop = parse_stop(req.get("stop"))
    if stop and tokenizer is None:
        raise ApiError(400, STOP_WITHOUT_TOKENIZER, "stop")
    stream = parse_stream(req)
    echo = req.get("echo")
    if echo is not None and not isinstance(echo, bool):
        raise ApiError(400, BOOLEAN_FIELD.format(field="echo"), "echo")
    try:
        top = fields.completion_logprobs(req, vocab_size)
        prompt_top = fields.prompt_logprobs(req, vocab_size, stream[0])
        if echo and top is not None:  # vLLM: echo with logprobs scores the prompt as many
            prompt_top = top if prompt_top is None else max(top, prompt_top)
        n = fields.choices(req)
        if n * len(prompts) > MAX_PROMPTS:
            raise fields.FieldError(N_TOO_MANY.format(n=n, prompts=len(prompts), total=n * len(prompts),
                                                      max=MAX_PROMPTS), "n")
        rules = fields.stop_rules(req, vocab_size)
        sampling = parse_sampling(req, has_draft, vocab_size, max_tokens, top, prompt_top)
        prompt_top_field, as_ids = fields.prompt_logprobs(req, vocab_size, stream[0]), fields.boolean(req, TOKEN_IDS)
    except fields.FieldError as e:
        raise ApiError(400, str(e), e.field) from None
    texts = tuple(p if isinstance(p, str) else tokenizer.decode(ids, False) if tokenizer else ""
                  for p, ids in zip(_prompt_list(req.get("prompt")), prompts)) if echo else ()
    return CompletionRequest(prompts, max_tokens, sampling, stop, *stream, parse_skip_special_tokens(req), n, rules,
                             bool(echo), texts, prompt_top_field, as_ids)


def _prompt_list(prompt) -> list:
    return [prompt] if isinstance(prompt, str) or _is_ids(prompt) else prompt


def parse_skip_special_tokens(req: dict) -> bool:
    v = req.get("skip_special_tokens")
    if v is not None and not isinstance(v, bool):
        raise ApiError(400, BOOLEAN_FIELD.format(field="skip_special_tokens"), "skip_special_tokens")
    return True if v is None else v


def _is_ids(v) -> bool:
    return isinstance(v, list) and bool(v) and all(isinstance(i, int) and not isinstance(i, bool) for i in v)


def parse_prompts(prompt, vocab_size: int | None = None, tokenizer: Tokenizer | None = None) -> tuple[list[int], ...]:
    """vLLM's four prompt shapes as token ids: a string, a list of ids, a list of strings, a list of id
    lists. Text needs ``tokenizer`` (none with --skip-tokenizer-init)."""
    if isinstance(prompt, str) or _is_ids(prompt):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) or _is_ids(p) for p in prompt):
        prompts = prompt
    else:
        raise ApiError(400, PROMPT_REQUIRED, "prompt")
    if len(prompts) > MAX_PROMPTS:
        raise ApiError(400, PROMPT_LIST_TOO_LONG.format(n=len(prompts), max=MAX_PROMPTS), "prompt")
    out = []
    for p in prompts:
        if isinstance(p, list):
            bad = next((i for i in p if i < 0 or (vocab_size is not None and i >= vocab_size)), None)
            if bad is not None:
                raise ApiError(400, TOKEN_OUT_OF_VOCAB.format(id=bad), "prompt")
            out.append(list(p))
            continue
        if not p:
            raise ApiError(400, PROMPT_REQUIRED, "prompt")
        if tokenizer is None:
            raise ApiError(400, TEXT_WITHOUT_TOKENIZER, "prompt")
        if not _encodable(p):  # "\ud800" is valid JSON but no text
            raise ApiError(400, PROMPT_SURROGATE, "prompt")
        out.append(tokenizer.encode(p))
    return tuple(out)


def check_max_tokens(field: str, max_tokens, max_model_len: int, prompt_tokens: int) -> int:
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int):
        raise ApiError(400, MAX_TOKENS_TYPE.format(field=field), field)
    limit = max_model_len - prompt_tokens
    if not 1 <= max_tokens <= limit:
        raise ApiError(400, MAX_TOKENS_RANGE.format(field=field, limit=max(limit, 0), max_model_len=max_model_len,
                                                    prompt_tokens=prompt_tokens), field)
    return max_tokens


def check_prompt_fits(max_model_len: int, prompt_tokens: int) -> None:
    if prompt_tokens >= max_model_len:
        raise ApiError(400, PROMPT_TOO_LONG.format(max_model_len=max_model_len, prompt_tokens=prompt_tokens))


def parse_sampling(req: dict, has_draft: bool, vocab_size: int | None = None, max_tokens: int = 1,
                   logprobs: int | None = None, prompt_logprobs: int | None = None) -> SamplingParams:
    """Every sampling setting (sampling_fields.py's beyond temperature, top_p and seed); raises
    ApiError, or sampling_fields.FieldError for those."""
    t = req.get("temperature", 0.0)
    t = 0.0 if t is None else t
    if not _number(t) or not 0 <= t <= 2:
        raise ApiError(400, TEMPERATURE.format(value=json.dumps(t)[:32]), "temperature")
    p = req.get("top_p", 1.0)
    p = 1.0 if p is None else p
    if not _number(p) or not 0 < p <= 1:
        raise ApiError(400, TOP_P.format(value=json.dumps(p)[:32]), "top_p")
    seed = req.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63):
        raise ApiError(400, SEED.format(value=json.dumps(seed)[:32]), "seed")
    if t > 0 and has_draft:
        raise ApiError(400, SAMPLING_WITH_DRAFT, "temperature")
    if has_draft and (logprobs is not None or prompt_logprobs is not None):
        field = "logprobs" if logprobs is not None else "prompt_logprobs"
        raise fields.FieldError(fields.DRAFT_SAMPLING_FIELD.format(field=field), field)
    return SamplingParams(float(t), float(p), seed, **fields.processing(req, vocab_size, max_tokens, has_draft),
                          logprobs=logprobs, prompt_logprobs=prompt_logprobs)


def parse_stop(stop) -> tuple[str, ...]:
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if (not isinstance(stops, list) or len(stops) > 4
            or not all(isinstance(s, str) and s and _encodable(s) for s in stops)):
        raise ApiError(400, STOP, "stop")
    return tuple(stops)


def _encodable(s: str) -> bool:
    try:
        s.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


def parse_stream(req: dict) -> tuple[bool, bool]:
    stream = req.get("stream", False)
    stream = False if stream is None else stream
    if not isinstance(stream, bool):
        raise ApiError(400, STREAM, "stream")
    opts = req.get("stream_options")
    if opts is None:
        return stream, False
    if (not stream or not isinstance(opts, dict) or set(opts) - {"include_usage"}
            or not isinstance(opts.get("include_usage", False), bool)):
        raise ApiError(400, STREAM_OPTIONS, "stream_options")
    return stream, opts.get("include_usage", False)


# -- answers ---------------------------------------------------------------------------------------
def new_id() -> str:
    return f"cmpl-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def total_usage(completions, n: int = 1) -> dict:
    """vLLM's counts: each prompt's tokens once (its n choices share it), every choice's tokens."""
    return usage(sum(c.prompt_tokens for c in completions[::n]), sum(len(c.token_ids) for c in completions))


def completion_body(cid: str, model: str, completion, req: CompletionRequest | None = None,
                    tokenizer: Tokenizer | None = None) -> dict:
    """A completion's answer; ``completion`` is one, or a list of one per choice (``req``'s order)."""
    done = completion if isinstance(completion, list) else [completion]
    req = req or CompletionRequest((), 0, SamplingParams(), (), False, False)
    tokenizer = None if req.tokens_as_ids else tokenizer
    choices = []
    for i, c in enumerate(done):
        choice = {"index": i, "text": (req.echo_texts[i // req.n] if req.echo else "") + c.text,
                  "token_ids": c.token_ids, "logprobs": None, "finish_reason": c.finish_reason,
                  "stop_reason": c.stop_reason}
        if req.sampling.logprobs is not None:
            fmt, parts = CompletionLogprobs(tokenizer, req.sampling.logprobs), []
            if req.echo:
                parts.append(fmt.part(c.prompt_ids, c.prompt_logprobs.entries))
            parts.append(fmt.part(c.token_ids, c.logprobs))
            choice["logprobs"] = {key: [x for part in parts for x in part[key]] for key in parts[0]}
        if req.prompt_logprobs is not None:
            choice["prompt_logprobs"] = prompt_logprobs(tokenizer, c.prompt_logprobs, req.prompt_logprobs)
        choices.append(choice)
    return {"id": cid, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": choices, "usage": total_usage(done, req.n)}


def stream_chunk(cid: str, created: int, model: str, text: str, finish_reason: str | None = None,
                 stop_reason: str | int | None = None, index: int = 0, logprobs: dict | None = None) -> dict:
    return {"id": cid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason,
                         "stop_reason": stop_reason}]}


def usage_chunk(cid: str, created: int, model: str, completion, obj: str = "text_completion", n: int = 1) -> dict:
    done = completion if isinstance(completion, list) else [completion]
    return {"id": cid, "object": obj, "created": created, "model": model, "choices": [],
            "usage": total_usage(done, n)}


def sse(payload: dict | str) -> bytes:
    """One server-sent event as vLLM writes it: ``data: <json>`` and a blank line."""
    data = payload if isinstance(payload, str) else json.dumps(payload)
    return f"data: {data}\n\n".encode()


DONE = "[DONE]"


def model_card(name: str, root: str, created: int, max_model_len: int | None) -> dict:
    """vLLM's ModelCard: ``id`` a served name, ``root`` the model directory."""
    return {"id": name, "object": "model", "created": created, "owned_by": "wcache", "root": root, "parent": None,
            "max_model_len": max_model_len}


def models_body(names, created: int, max_model_len: int | None, root: str | None = None) -> dict:
    """``GET /v1/models`` in vLLM's shape: a ModelCard per served name (``names``: one or a sequence)."""
    names = (names,) if isinstance(names, str) else tuple(names)
    return {"object": "list", "data": [model_card(n, root or names[0], created, max_model_len) for n in names]}


class CompletionStream:
    """A streamed completion's events as vLLM sends them: a chunk per piece of text (``index`` the
    choice's; with logprobs, a chunk per token, its scores with it; with echo, the prompt's text
    first), a chunk with each choice's finish reason, the usage chunk if asked, ``[DONE]``."""

    def __init__(self, model: str, include_usage: bool, req: CompletionRequest | None = None,
                 tokenizer: Tokenizer | None = None):
        self.cid, self.created, self.model, self.include_usage = new_id(), int(time.time()), model, include_usage
        self.req = req or CompletionRequest((), 0, SamplingParams(), (), True, include_usage)
        self.tokenizer = None if self.req.tokens_as_ids else tokenizer
        self.logprobs: dict[int, CompletionLogprobs] = {}  # a choice's, once it has begun

    def first(self) -> list:
        return []

    def _begin(self, index: int) -> str:
        """The echoed prompt's text the first time a choice sends anything."""
        if index in self.logprobs:
            return ""
        self.logprobs[index] = CompletionLogprobs(self.tokenizer, self.req.sampling.logprobs or 0)
        return self.req.echo_texts[index // self.req.n] if self.req.echo else ""

    def text(self, index: int, piece: str) -> list:
        echo = self._begin(index)
        logprobs = None
        if self.req.sampling.logprobs is not None:
            fmt, parts = self.logprobs[index], []
            if echo and piece.prompt is not None:
                parts.append(fmt.part(piece.prompt.ids, piece.prompt.entries))
            parts.append(fmt.part([t.id for t in piece.tokens], piece.tokens))
            logprobs = {key: [x for part in parts for x in part[key]] for key in parts[0]}
        return [stream_chunk(self.cid, self.created, self.model, echo + piece, index=index, logprobs=logprobs)]

    def done(self, index: int, completion) -> list:
        return [stream_chunk(self.cid, self.created, self.model, self._begin(index), completion.finish_reason,
                             completion.stop_reason, index=index)]

    def last(self, completions: list) -> list:
        usage = ([usage_chunk(self.cid, self.created, self.model, completions, n=self.req.n)]
                 if self.include_usage else [])
        return [*usage, DONE]
