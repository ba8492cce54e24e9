"""`wcache serve` as a front process and an engine core (the default; WCACHE_ENABLE_V1_MULTIPROCESSING=0
runs one process, engine/api_server/front.py): real processes, real HTTP, the same answers as one process gives."""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from http.client import HTTPConnection
from pathlib import Path

import pytest
from procs import alive, child_pids, complete, free_port, http, wait_until

ENV = "WCACHE_ENABLE_V1_MULTIPROCESSING"
CORE_PID = re.compile(r"Engine ready \(pid (\d+), engine core pid (\d+)\)")
PROMPTS = ["Hello", "The cat", "Once upon a time", "a b c", "weights", "GPU", "1 2 3", "stream me"]


LONG = 500  # tokens: about a second of decoding on a 2-core CPU, far longer than a test's next step


def serve(procs, model, *extra):
    p = procs.serve(model, "--max-model-len", "512", *extra)  # the default: two processes
    p.front_pid, p.core_pid = map(int, CORE_PID.search(p.log()).groups())
    return p


@pytest.fixture(scope="module")
def engine(module_procs, tiny_model):
    return serve(module_procs, tiny_model)


def url(engine, path: str) -> str:
    return f"http://127.0.0.1:{engine.port}{path}"


def maps(pid: int) -> str:
    return Path(f"/proc/{pid}/maps").read_text()


def stream(port: int, body: dict, path: str = "/v1/completions") -> tuple[int, list]:
    """(status, the events' payloads, "[DONE]" as it is) of one streamed request."""
    conn = HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("POST", path, json.dumps({**body, "stream": True}), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    data = resp.read().decode()
    conn.close()
    events = [e[6:] for e in data.split("\n\n") if e.startswith("data: ")]
    return resp.status, [e if e == "[DONE]" else json.loads(e) for e in events]


class Streaming:
    """A streamed completion read event by event."""

    def __init__(self, port: int, body: dict):
        self.conn = HTTPConnection("127.0.0.1", port, timeout=60)
        self.conn.request("POST", "/v1/completions", json.dumps({**body, "stream": True}),
                          {"Content-Type": "application/json"})
        self.resp = self.conn.getresponse()
        assert self.resp.status == 200

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.conn.close()

    def _event(self):
        while True:
            line = self.resp.readline()
            if not line:
                return None
            line = line.decode().strip()
            if line.startswith("data: "):
                data = line[6:]
                return data if data == "[DONE]" else json.loads(data)

    def first_event(self):
        return self._event()

    def rest(self) -> list:
        out = []
        while (e := self._event()) is not None:
            out.append(e)
        return out


def test_the_front_has_no_torch_and_the_core_has(engine):
    assert engine.pid == engine.front_pid
    assert "libtorch" not in maps(engine.front_pid)
    assert "libtorch" in maps(engine.core_pid)


def test_the_variable_unset_or_1_is_two_processes_0_is_one_and_any_other_value_is_refused(engine, procs, tiny_model):
    if ENV in os.environ:
        pytest.skip(f"{ENV} is set in this run's environment, so no engine here runs with the default")
    assert engine.core_pid != engine.front_pid  # the module's engine, started without the variable
    on = procs.serve(tiny_model, "--max-model-len", "512", env={ENV: "1"})
    assert CORE_PID.search(on.log())
    off = procs.serve(tiny_model, "--max-model-len", "512", env={ENV: "0"})
    assert "engine core pid" not in off.log() and "libtorch" in maps(off.pid)
    assert not [c for c in child_pids(off.pid) if b"core_proc" in Path(f"/proc/{c}/cmdline").read_bytes()]
    for value in ("", "yes", "true", "2"):
        bad = procs.serve(tiny_model, env={ENV: value}, ready=False)
        assert bad.exit_code(60) == 2, bad.log()
        assert (f"WCACHE_ENABLE_V1_MULTIPROCESSING must be 1 (the default: a front process and an engine core) "
                f"or 0 (one process), not {value!r}") in bad.log()


def test_completions_streamed_and_not_are_the_same_text(engine):
    body = complete(engine.port, "Hello", 12)
    assert body["usage"]["completion_tokens"] == 12 and body["choices"][0]["finish_reason"] == "length"
    status, events = stream(engine.port, {"prompt": "Hello", "max_tokens": 12})
    assert status == 200 and events[-1] == "[DONE]"
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == body["choices"][0]["text"]


def test_concurrent_clients_get_their_lone_runs_text(engine):
    alone = {p: complete(engine.port, p, 16)["choices"][0] for p in PROMPTS}
    with ThreadPoolExecutor(len(PROMPTS) * 2) as pool:
        together = list(pool.map(lambda p: (p, complete(engine.port, p, 16)["choices"][0]), PROMPTS * 2))
    for prompt, choice in together:
        assert (choice["text"], choice["token_ids"]) == (alone[prompt]["text"], alone[prompt]["token_ids"]), prompt


def test_logprobs_prompt_scores_and_stop_settings_cross_the_channel_unchanged(engine, procs, tiny_model):
    """What api-2 added crosses the channel as one process computes it: each token's logprob, rank
    and top logprobs, the echoed prompt's scores, min_tokens' held ids and ignore_eos. Compared with a
    one-process engine on the same checkpoint (the variable off). The break it catches: a Token
    sent without its logprob fields (core_messages.token_of) fails here, in CI, where the parity
    tests run one process."""
    body = {"prompt": "Hello", "max_tokens": 12, "logprobs": 3, "echo": True, "min_tokens": 4, "ignore_eos": True,
            "return_tokens_as_token_ids": True}
    one = procs.serve(tiny_model, "--max-model-len", "512", env={ENV: "0"})
    status, split = http("POST", url(engine, "/v1/completions"), body)
    assert status == 200, split
    status, alone = http("POST", f"http://127.0.0.1:{one.port}/v1/completions", body)
    assert status == 200, alone
    a, b = split["choices"][0], alone["choices"][0]
    assert a["logprobs"]["token_logprobs"][0] is None and len(a["logprobs"]["tokens"]) > 12  # the prompt's, then 12
    assert a["logprobs"]["top_logprobs"][-1] and a["logprobs"]["token_logprobs"][-1] is not None
    assert (a["text"], a["token_ids"], a["finish_reason"]) == (b["text"], b["token_ids"], b["finish_reason"])
    assert a["logprobs"] == b["logprobs"]


def test_a_stop_string_ends_the_text_in_the_front(engine):
    text = complete(engine.port, "Once upon a time", 16)["choices"][0]["text"]
    stop = text[3:5]
    assert stop and stop in text
    choice = http("POST", url(engine, "/v1/completions"),
                  {"prompt": "Once upon a time", "max_tokens": 16, "stop": [stop]})[1]["choices"][0]
    assert choice["text"] == text[:text.index(stop)]
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", stop)


def test_chat_streamed_and_not(engine):
    messages = [{"role": "user", "content": "Hello"}]
    status, body = http("POST", url(engine, "/v1/chat/completions"), {"messages": messages, "max_tokens": 8})
    assert status == 200 and body["object"] == "chat.completion"
    status, events = stream(engine.port, {"messages": messages, "max_tokens": 8}, "/v1/chat/completions")
    assert status == 200 and events[-1] == "[DONE]"
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events[:-1] if e["choices"])
    assert text == body["choices"][0]["message"]["content"]


def test_metrics_count_what_the_front_served(engine):
    def metrics() -> str:
        return http_text(url(engine, "/metrics"))

    before = _value(metrics(), 'vllm:generation_tokens_total{engine="0",model_name=')
    complete(engine.port, "Hello", 5)
    after = metrics()
    assert _value(after, 'vllm:generation_tokens_total{engine="0",model_name=') == before + 5
    assert 'wcache_engine_ready{model_name=' in after and 'source="disk"' in after
    assert "vllm:num_requests_running" in after and "vllm:num_requests_waiting" in after


def test_a_running_request_shows_in_the_running_gauge(engine):
    with Streaming(engine.port, {"prompt": "Hello", "max_tokens": LONG}) as s:
        s.first_event()
        running = _value(http_text(url(engine, "/metrics")), "vllm:num_requests_running{")
        assert running == 1.0, "a request decoding for about a second is not in the gauge"
        s.rest()
    wait_until(lambda: _value(http_text(url(engine, "/metrics")), "vllm:num_requests_running{") == 0.0, 10,
               "the gauge back at 0")


def http_text(address: str) -> str:
    import urllib.request

    with urllib.request.urlopen(address, timeout=30) as r:
        return r.read().decode()


def _value(text: str, prefix: str) -> float:
    for line in text.splitlines():
        if line.startswith(prefix):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_sigterm_drains_in_the_front_then_stops_the_core(engine):
    """Runs last among the module engine's tests: it stops it."""
    status: list = []
    t = threading.Thread(target=lambda: status.append(stream(engine.port, {"prompt": "Hello", "max_tokens": 60})))
    t.start()
    wait_until(lambda: "POST /v1/completions" in engine.log() or not t.is_alive(), 10, "the stream's start")
    time.sleep(0.05)
    assert engine.stop(signal.SIGTERM) == 0
    t.join(30)
    code, events = status[0]
    assert code == 200 and events[-1] == "[DONE]"
    log = engine.log()
    assert "Received SIGTERM, shutting down" in log and "Engine core stopped" in log and "Engine stopped" in log
    wait_until(lambda: not alive(engine.core_pid), 10, "the core's exit")


def test_an_api_key_guards_every_v1_route(procs, tiny_model):
    e = serve(procs, tiny_model, "--api-key", "sesame")
    assert http("POST", url(e, "/v1/completions"), {"prompt": "Hi", "max_tokens": 1})[0] == 401
    import urllib.request

    req = urllib.request.Request(url(e, "/v1/completions"), json.dumps({"prompt": "Hi", "max_tokens": 1}).encode(),
                                 {"Authorization": "Bearer sesame", "Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        assert r.status == 200 and json.loads(r.read())["usage"]["completion_tokens"] == 1
    assert http("GET", url(e, "/health"))[0] == 200


def test_the_core_killed_fails_the_requests_in_flight_and_the_front_exits(procs, tiny_model):
    e = serve(procs, tiny_model)
    with Streaming(e.port, {"prompt": "Hello", "max_tokens": LONG}) as s:
        s.first_event()
        os.kill(e.core_pid, signal.SIGKILL)
        events = s.rest()
    assert events[-1] == "[DONE]" and "error" in events[-2], events[-3:]
    assert events[-2]["error"]["message"] == "the engine failed: the engine core exited (status -9)"
    assert events[-2]["error"]["code"] == 500
    assert e.exit_code(30) == 1
    log = e.log()
    assert (f"The engine core (pid {e.core_pid}) exited with status -9; the requests in flight fail and /health "
            "answers 503") in log


def test_the_core_refusing_its_flags_stops_the_front_with_its_status(procs, tiny_model):
    p = procs.serve(tiny_model, "--max-model-len", "100000", ready=False)
    assert p.exit_code(60) == 2
    assert "max_model_len" in p.log() or "max-model-len" in p.log()


def test_health_is_503_until_the_core_has_loaded(procs, tiny_model):
    p = procs.serve(tiny_model, ready=False)
    port, seen = p.port, []
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and (not seen or seen[-1][0] != 200):
        try:
            seen.append(http("GET", f"http://127.0.0.1:{port}/health", timeout=5))
        except OSError:  # not bound yet: the core is still planning its ranks
            assert p.proc.poll() is None, p.log()
        time.sleep(0.01)
    assert seen[0] == (503, {"status": "loading"}), seen[:3]
    assert seen[-1] == (200, {"status": "ok"})
    assert complete(port, "Hello", 2)["usage"]["completion_tokens"] == 2


def test_the_front_killed_stops_the_core(procs, tiny_model):
    e = serve(procs, tiny_model)
    os.kill(e.front_pid, signal.SIGKILL)
    wait_until(lambda: not alive(e.core_pid), 30, "the core's exit after its front's")
    assert "The front process is gone (its channel closed): the engine core stops" in e.log()


def test_tensor_parallel_ranks_follow_the_core_and_a_dead_one_turns_health_to_503(procs, tmp_path_factory):
    """TP=2: the core is engine rank 0 and starts the other rank; both answer as one process's did.
    A rank that dies after start-up turns the front's /health to 503 (the supervisor's line)."""
    from wcache.core.checkpoint import make_checkpoint
    from wcache.engine.worker.supervisor import WORKERS_EXITED

    model = make_checkpoint(tmp_path_factory.mktemp("tp") / "tiny32", "tiny", dtype="float32")
    one = serve(procs, model)
    expected = complete(one.port, "Hello", 12)["choices"][0]["token_ids"]
    one.stop()
    two = serve(procs, model, "-tp", "2", "--master-port", str(free_port()), "--no-enable-autotune")
    assert complete(two.port, "Hello", 12)["choices"][0]["token_ids"] == expected
    assert child_pids(two.front_pid) == [two.core_pid]
    (rank1,) = child_pids(two.core_pid)
    os.kill(rank1, signal.SIGKILL)
    wait_until(lambda: http("GET", url(two, "/health"))[0] == 503, what="/health 503")
    assert WORKERS_EXITED.format(codes={1: -9}) in two.log()
