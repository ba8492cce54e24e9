"""Log-probabilities against transformers: a float32 Llama checkpoint written by transformers itself
(hf_reference.py, in a subprocess), served by a real `wcache serve --dtype float32`; every number the
answer carries (each generated token's logprob and its top 5, each echoed prompt token's, the
prompt_logprobs with their ranks) must equal ``log_softmax`` of transformers' own logits, computed
here from the saved files on the same ids, within 1e-4, and name the same tokens. Greedy and
sampled, plain and streamed.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import prompt_ids as tokenizer
import pytest
import torch
from procs import _healthy, free_port

HERE = Path(__file__).parent
TOL = 1e-4
TOP = 5
CONFIG = {"vocab_size": 320, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
          "bos_token_id": tokenizer.BOS_ID, "eos_token_id": tokenizer.EOS_ID,
          "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("lp")
    spec = [{"name": "lp", "config": CONFIG, "dtype": "float32", "seed": 1, "init_std": 0.2, "text": "Hello, world",
             "max_tokens": 2, "eos_id": tokenizer.EOS_ID, "out": str(tmp / "lp")}]
    (tmp / "spec.json").write_text(json.dumps(spec))
    p = subprocess.run([sys.executable, str(HERE / "hf_reference.py"), str(tmp / "spec.json")], capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    return tmp / "lp" / "model"


@pytest.fixture(scope="module")
def hf_model(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def port(module_procs, model_dir):
    port = free_port()
    p = module_procs.start("serve", str(model_dir), "--device", "cpu", "--host", "127.0.0.1", "--port", str(port),
                           "--dtype", "float32", "--max-model-len", "64", "--no-enable-autotune", name="serve-lp")
    p.wait_for(lambda: _healthy(port), what="/health 200")
    return port


@pytest.fixture(scope="module")
def client(port):
    import openai

    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=120)


def hf_logprobs(hf_model, ids: list[int]) -> torch.Tensor:
    """transformers' log_softmax at every position of ``ids`` (row i scores token i + 1)."""
    with torch.no_grad():
        return torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].float(), dim=-1)


def tid(text: str) -> int:
    return int(text.removeprefix("token_id:"))


def check_position(ref: torch.Tensor, token: int, logprob: float, top: dict) -> None:
    """One scored position: the token's logprob and the top 5 (and the token) as transformers has them."""
    assert abs(logprob - float(ref[token])) < TOL, (token, logprob, float(ref[token]))
    want = torch.topk(ref, TOP)
    expected = {int(i): float(v) for i, v in zip(want.indices, want.values)}
    expected[token] = float(ref[token])
    got = {tid(k): v for k, v in top.items()}
    assert set(got) == set(expected), (got, expected)
    assert all(abs(got[i] - expected[i]) < TOL for i in got), (got, expected)


PROMPT = tokenizer.encode("Hello, world")


@pytest.mark.parametrize("sampling", [{}, {"temperature": 1.0, "seed": 3}], ids=["greedy", "sampled"])
def test_echo_and_generated_logprobs_are_transformers_log_softmax(client, hf_model, sampling):
    c = client.completions.create(model=client.models.list().data[0].id, prompt=PROMPT, max_tokens=10, echo=True,
                                  logprobs=TOP, extra_body={"return_tokens_as_token_ids": True}, **sampling)
    [choice] = c.choices
    lp = choice.logprobs
    ids = PROMPT + choice.token_ids
    assert [tid(t) for t in lp.tokens] == ids
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # nothing scores the first token
    ref = hf_logprobs(hf_model, ids)
    for i in range(1, len(ids)):
        check_position(ref[i - 1], ids[i], lp.token_logprobs[i], lp.top_logprobs[i])


def test_streamed_sampled_logprobs_match_transformers(client, hf_model):
    chunks = list(client.completions.create(model=client.models.list().data[0].id, prompt=PROMPT, max_tokens=10,
                                            logprobs=TOP, temperature=1.2, seed=8, stream=True,
                                            extra_body={"return_tokens_as_token_ids": True}))
    parts = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
    out = [tid(t) for p in parts for t in p.tokens]
    lps = [x for p in parts for x in p.token_logprobs]
    tops = [x for p in parts for x in p.top_logprobs]
    assert len(out) == 10
    ref = hf_logprobs(hf_model, PROMPT + out)
    for k, tok in enumerate(out):
        check_position(ref[len(PROMPT) + k - 1], tok, lps[k], tops[k])


def test_prompt_logprobs_and_ranks_match_transformers(client, hf_model):
    c = client.completions.create(model=client.models.list().data[0].id, prompt=PROMPT, max_tokens=1,
                                  extra_body={"prompt_logprobs": TOP})
    scores = c.choices[0].model_extra["prompt_logprobs"]
    ref = hf_logprobs(hf_model, PROMPT)
    assert scores[0] is None and len(scores) == len(PROMPT)
    for i in range(1, len(PROMPT)):
        row, entry = ref[i - 1], scores[i]
        rank = int((row > row[PROMPT[i]]).sum()) + 1
        assert entry[str(PROMPT[i])]["rank"] == rank
        top = torch.topk(row, TOP)
        for r, (t, v) in enumerate(zip(top.indices.tolist(), top.values.tolist()), 1):
            assert abs(entry[str(t)]["logprob"] - v) < TOL and entry[str(t)]["rank"] == (r if t != PROMPT[i] else rank)
        assert abs(entry[str(PROMPT[i])]["logprob"] - float(row[PROMPT[i]])) < TOL


def test_chat_logprobs_match_transformers(client, hf_model, model_dir):
    from transformers import AutoTokenizer

    messages = [{"role": "user", "content": "Hello"}]
    c = client.chat.completions.create(model=client.models.list().data[0].id, messages=messages, max_tokens=8,
                                       logprobs=True, top_logprobs=TOP, extra_body={"return_tokens_as_token_ids": True})
    content = c.choices[0].logprobs.content
    prompt = AutoTokenizer.from_pretrained(model_dir).apply_chat_template(messages, add_generation_prompt=True,
                                                                          tokenize=True)
    prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
    assert len(prompt) == c.usage.prompt_tokens
    out = [tid(e.token) for e in content]
    ref = hf_logprobs(hf_model, prompt + out)
    for k, e in enumerate(content):
        row = ref[len(prompt) + k - 1]
        assert abs(e.logprob - float(row[out[k]])) < TOL
        want = torch.topk(row, TOP)
        assert [tid(t.token) for t in e.top_logprobs] == want.indices.tolist()
        assert all(abs(t.logprob - v) < TOL for t, v in zip(e.top_logprobs, want.values.tolist()))
