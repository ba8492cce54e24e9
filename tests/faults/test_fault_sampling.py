"""A hostile client against the sampling and scoring parameters of a live `wcache serve` (tiny
checkpoint, CPU): values at the ends of their accepted ranges, numbers past float's range, NaN and
Infinity (Python's json reads them), booleans where integers go, ids outside the vocabulary, the
most choices, streamed and chat variants, and n=64 against a small waiting queue. Each attack gets its answer (a 200, or a 400 with the
code's text, never a dropped connection), and after each one the server still answers a plain
completion and /health is 200, with no traceback in its log. docs/faults.md lists them
("Sampling values at the ends of their ranges", "Numbers past float's range").
"""

from __future__ import annotations

import json
import re
import time
import urllib.error
import urllib.request

import pytest
from wcache.engine.core.core_engine import STATUS_INTERVAL_S

from wcache.errors import (
    INTEGER_FIELD, LOGIT_BIAS_KEY, LOGIT_BIAS_SHAPE, LOGIT_BIAS_VOCAB, LOGPROBS_TOO_MANY, MIN_TOKENS_OVER_MAX,
    N_TOO_MANY, NUMBER_FIELD, PROMPT_LOGPROBS_STREAM, QUEUE_FULL, STOP_TOKEN_IDS, TEMPERATURE, TOKEN_OUT_OF_VOCAB,
    TOP_P,
)

VOCAB = 512  # the tiny preset's
HUGE = "1" + "0" * 400  # valid JSON, an int past float's range: math.isfinite raises OverflowError on it
CHAT = [{"role": "user", "content": "Hello"}]
EVERY_ID = list(range(VOCAB))


@pytest.fixture(scope="module")
def engine(fault_procs, tiny_model):
    return fault_procs.serve(tiny_model, "--no-enable-autotune")


def post(port: int, path: str, body: bytes) -> tuple[int, str]:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=body,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def health(port: int) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=10) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def js(**fields) -> bytes:
    return json.dumps(fields).encode()


def raw(template: str) -> bytes:
    """A body with a bare number JSON cannot otherwise hold (``{HUGE}``, NaN, Infinity)."""
    return template.replace("{HUGE}", HUGE).encode()


C, CH = "/v1/completions", "/v1/chat/completions"

# Values the checks accept, at the ends of their ranges, that reached the sampler: each one stopped
# the engine loop (torch.multinomial on NaN probabilities), and every request after it failed.
SAMPLED_EXTREMES = {  # name: (path, body)
    "temperature 1e-300": (C, js(prompt="Hello", max_tokens=4, temperature=1e-300)),
    "temperature 1e-40, streamed": (C, js(prompt="Hello", max_tokens=4, temperature=1e-40, stream=True)),
    "temperature 1e-300, n=4": (C, js(prompt="Hello", max_tokens=4, temperature=1e-300, n=4)),
    "temperature 1e-300, chat": (CH, js(messages=CHAT, max_tokens=4, temperature=1e-300)),
    "repetition_penalty 1e-40": (C, js(prompt="Hello Hello", max_tokens=4, temperature=1.0,
                                       repetition_penalty=1e-40)),
    "repetition_penalty 1e39, logprobs": (C, js(prompt="Hello Hello", max_tokens=4, temperature=1.0,
                                                repetition_penalty=1e39, logprobs=5)),
    "min_tokens with every id a stop id": (C, js(prompt="Hello", max_tokens=4, temperature=1.0, min_tokens=2,
                                                 stop_token_ids=EVERY_ID)),
    "min_tokens with every id a stop id, chat streamed": (CH, js(messages=CHAT, max_tokens=4, temperature=1.0,
                                                                 min_tokens=2, stop_token_ids=EVERY_ID,
                                                                 stream=True)),
}

# Refused with the code's text; the first group got no answer at all (an OverflowError on the
# request's thread dropped the connection); the rest are defences that held, recorded.
REFUSED = {  # name: (path, body, a piece of the message)
    "temperature 1e400 as an integer": (C, raw('{"prompt": "Hi", "temperature": {HUGE}}'),
                                        TEMPERATURE.format(value=HUGE[:32])),
    "top_p -1e400 as an integer": (C, raw('{"prompt": "Hi", "top_p": -{HUGE}}'), TOP_P.format(value="-" + HUGE[:31])),
    "presence_penalty 1e400": (C, raw('{"prompt": "Hi", "presence_penalty": {HUGE}}'),
                               NUMBER_FIELD.format(field="presence_penalty", value=HUGE[:32])),
    "repetition_penalty 1e400": (C, raw('{"prompt": "Hi", "repetition_penalty": {HUGE}}'),
                                 NUMBER_FIELD.format(field="repetition_penalty", value=HUGE[:32])),
    "min_p 1e400, chat": (CH, raw('{"messages": [{"role": "user", "content": "Hi"}], "min_p": {HUGE}}'),
                          NUMBER_FIELD.format(field="min_p", value=HUGE[:32])),
    "a logit_bias of 1e400": (C, raw('{"prompt": "Hi", "logit_bias": {"5": {HUGE}}}'), LOGIT_BIAS_SHAPE),
    # defences that held
    "a logit_bias of NaN": (C, raw('{"prompt": "Hi", "logit_bias": {"5": NaN}}'), LOGIT_BIAS_SHAPE),
    "a logit_bias of Infinity, chat": (CH, raw('{"messages": [{"role": "user", "content": "Hi"}], '
                                               '"logit_bias": {"5": Infinity}}'), LOGIT_BIAS_SHAPE),
    "a logit_bias of true": (C, js(prompt="Hi", logit_bias={"5": True}), LOGIT_BIAS_SHAPE),
    "a logit_bias key that is no integer": (C, js(prompt="Hi", logit_bias={"1.5": 1}), LOGIT_BIAS_KEY.format(key="1.5")),
    "a logit_bias key of 2**70": (C, js(prompt="Hi", logit_bias={str(2**70): 1}),
                                  LOGIT_BIAS_VOCAB.format(ids=[2**70], vocab=VOCAB)),
    "a negative logit_bias key": (C, js(prompt="Hi", logit_bias={"-1": 1}), LOGIT_BIAS_VOCAB.format(ids=[-1], vocab=VOCAB)),
    "a stop_token_id of 2**70": (C, js(prompt="Hi", stop_token_ids=[2**70]), TOKEN_OUT_OF_VOCAB.format(id=2**70)),
    "a stop_token_id of true": (C, js(prompt="Hi", stop_token_ids=[True]), STOP_TOKEN_IDS),
    "top_k 1.0": (C, js(prompt="Hi", top_k=1.0), INTEGER_FIELD.format(field="top_k", value="1.0")),
    "n true": (C, js(prompt="Hi", n=True), INTEGER_FIELD.format(field="n", value="true")),
    "n 33 for 2 prompts": (C, js(prompt=["Hi", "Yo"], n=33), N_TOO_MANY.format(n=33, prompts=2, total=66, max=64)),
    "logprobs 21": (C, js(prompt="Hi", logprobs=21), LOGPROBS_TOO_MANY.format(n=21, max=20)),
    "prompt_logprobs streamed": (C, js(prompt="Hi", prompt_logprobs=1, stream=True), PROMPT_LOGPROBS_STREAM),
    "min_tokens over max_tokens": (C, js(prompt="Hi", max_tokens=4, min_tokens=5),
                                   MIN_TOKENS_OVER_MAX.format(max_tokens=4, value=5)),
}


def still_serving(engine) -> None:
    status, body = post(engine.port, C, js(prompt="Hello", max_tokens=4))
    assert status == 200 and len(json.loads(body)["choices"][0]["token_ids"]) >= 1, (status, body)
    assert health(engine.port) == 200
    assert "Traceback" not in engine.log()


@pytest.mark.parametrize("case", list(SAMPLED_EXTREMES))
def test_sampling_values_at_the_ends_of_their_ranges_are_served_and_the_engine_goes_on(engine, case):
    path, body = SAMPLED_EXTREMES[case]
    status, answer = post(engine.port, path, body)
    assert status == 200, (status, answer)
    if b'"stream": true' in body:
        assert answer.rstrip().endswith("data: [DONE]") and '"error"' not in answer, answer[-300:]
    else:
        assert json.loads(answer)["choices"], answer
    still_serving(engine)


@pytest.mark.parametrize("case", list(REFUSED))
def test_hostile_numbers_and_ids_get_a_400_with_the_codes_text(engine, case):
    path, body, piece = REFUSED[case]
    status, answer = post(engine.port, path, body)
    assert status == 400 and piece in json.loads(answer)["error"]["message"], (status, answer)
    still_serving(engine)


# -- n against --max-waiting-requests ------------------------------------------------------------
SMALL_QUEUE = ("--max-waiting-requests", "4", "--max-num-seqs", "2")
LONG = 480  # tokens each sequence may make (the tiny preset's model length is 512)


@pytest.fixture(scope="module")
def small_queue(fault_procs, tiny_model):
    return fault_procs.serve(tiny_model, "--no-enable-autotune", *SMALL_QUEUE)


def gauges(port: int) -> tuple[float, float]:
    """(running, waiting) from /metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    return tuple(float(re.search(rf"^vllm:num_requests_{name}{{.*}} (\S+)$", text, re.M).group(1))
                 for name in ("running", "waiting"))


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_n_64_refused_by_a_full_queue_leaves_nothing_running(small_queue, stream):
    """n=64 with a queue of 4 and 2 running: 58 choices are refused, and so is the request (503).
    The 6 admitted ran on to max_tokens before (the whole answer came after them, some 7 s; a
    stream's kept going after its 503), holding the queue for an answer nobody gets. Now they stop
    at their next token: the engine is idle again well inside the time one long sequence takes."""
    port = small_queue.port
    t0 = time.perf_counter()
    status, _ = post(port, C, js(prompt="Hi", max_tokens=LONG, ignore_eos=True))
    one_long = time.perf_counter() - t0
    assert status == 200

    t0 = time.perf_counter()
    status, answer = post(port, C, js(prompt="Hi", n=64, max_tokens=LONG, ignore_eos=True, stream=stream))
    assert status == 503 and json.loads(answer)["error"]["message"] == QUEUE_FULL.format(waiting=4, max=4), answer
    # With two processes (the default) the front's gauges are the core's last Status, sent when they
    # change, at most every STATUS_INTERVAL_S: read them only once the admitted choices are in one
    # (they read (0, 0) from before the request otherwise, and the queue was still full after).
    time.sleep(3 * STATUS_INTERVAL_S)
    while gauges(port) != (0.0, 0.0) and time.perf_counter() - t0 < 6 * one_long:
        time.sleep(0.02)
    idle_after = time.perf_counter() - t0
    # Running on, the 6 admitted take 3 rounds of 2: 3 x one_long. Stopped, a few steps.
    assert idle_after < one_long / 2, (idle_after, one_long)
    still_serving(small_queue)
