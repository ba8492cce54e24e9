"""`wcache serve --respawn` as a front and engine cores (the default layout,
engine/api_server/front_failover.py): the serving core SIGKILLed under real clients on real HTTP; the front
keeps every connection and the streams in flight go on from the promoted spare core."""

from __future__ import annotations

import json
import os
import re
import signal
import statistics
import threading
import time
from http.client import HTTPConnection
from pathlib import Path

import pytest
from itest import run_cli, wait_until
from procs import http
from wcache.engine.api_server.core_client import FAILOVER_TIMELINE
from wcache.engine.core.failover_policy import MAX_DEATHS, STABLE_S

READY = re.compile(r"Engine ready \(pid (\d+), engine core pid (\d+)\)")
SPARE_READY = re.compile(r"Spare engine core pid (\d+) ready")
PROMOTED = re.compile(r"Engine core pid (\d+) promoted")
LONG = 300  # tokens: some 1.5 s of four streams decoding together on a 2-core CPU
PROMPTS = ["Hello", "The cat", "Once upon a time", "weights"]
KILL_TO_200_MS = 50.0  # the target on CPU (tiny model)
HEARTBEAT_TIMEOUT_S = 2.0  # a busy core beats every 0.1 s: twenty beats missed on a loaded 2-core host
TIMELINE = re.compile(FAILOVER_TIMELINE.replace("{json}", "(.*)"))
HUNG = re.compile(r"Engine core pid (\d+) hung: no frame for ([\d.]+) s with requests in flight")


@pytest.fixture
def engine(procs, tiny_model):  # one per test: the kills of several tests would add up to a give-up
    p = procs.serve(tiny_model, "--max-model-len", "512", "--respawn", "--respawn-heartbeat-timeout",
                           str(HEARTBEAT_TIMEOUT_S)).wait_for_log("Engine ready")
    p.front_pid, p.first_core = map(int, READY.search(p.log()).groups())
    return p


def serving_core(engine) -> int:
    promoted = PROMOTED.findall(engine.log())
    return int(promoted[-1]) if promoted else engine.first_core


def wait_spare(engine) -> None:
    """Until the spare that replaces the last promoted one is ready (one spare per promotion, plus the first)."""
    want = len(PROMOTED.findall(engine.log())) + 1
    engine.wait_for(lambda: len(SPARE_READY.findall(engine.log())) >= want, 120, "a ready spare engine core")


class Stream(threading.Thread):
    """A streamed request read event by event on its own thread; ``started`` once ``after`` events came."""

    def __init__(self, port: int, body: dict, path: str = "/v1/completions", after: int = 8):
        super().__init__(daemon=True)
        self.port, self.body, self.path, self.after = port, body, path, after
        self.events: list = []
        self.started_ = threading.Event()
        self.start()

    def run(self) -> None:
        conn = HTTPConnection("127.0.0.1", self.port, timeout=120)
        conn.request("POST", self.path, json.dumps({**self.body, "stream": True}), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200
        while line := resp.readline():
            line = line.decode().strip()
            if line.startswith("data: "):
                data = line[6:]
                self.events.append(data if data == "[DONE]" else json.loads(data))
                if len(self.events) >= self.after:
                    self.started_.set()
        self.started_.set()
        conn.close()

    def result(self) -> list:
        self.join(120)
        assert not self.is_alive()
        return self.events


def text_of(events: list, chat: bool = False) -> str:
    if chat:
        return "".join(e["choices"][0]["delta"].get("content") or "" for e in events
                       if isinstance(e, dict) and e.get("choices"))
    return "".join(e["choices"][0]["text"] for e in events if isinstance(e, dict) and e.get("choices"))


def whole(events: list, reference: list, chat: bool = False) -> None:
    """Every token once, in order, then [DONE]; no error event."""
    assert not [e for e in events if isinstance(e, dict) and "error" in e], events[-3:]
    assert events and events[-1] == "[DONE]", events[-3:]
    got, want = text_of(events, chat), text_of(reference, chat)
    at = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    assert got == want, (f"{len(events)} events against {len(reference)}, {len(got)} characters against "
                         f"{len(want)}, first difference at {at}: {got[max(0, at - 20):at + 20]!r} "
                         f"against {want[max(0, at - 20):at + 20]!r}")


def kill_serving_core(engine) -> float:
    pid = serving_core(engine)
    t = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    return t


def test_four_greedy_streams_go_on_through_three_kills_with_the_uncrashed_text(engine):
    bodies = [{"prompt": p, "max_tokens": LONG, "ignore_eos": True} for p in PROMPTS]
    reference = [Stream(engine.port, b).result() for b in bodies]
    assert all(len(text_of(r)) > 0 and r[-1] == "[DONE]" for r in reference)
    kill_to_200, kills = [], []
    for _ in range(3):
        wait_spare(engine)
        streams = [Stream(engine.port, b) for b in bodies]
        for s in streams:
            assert s.started_.wait(60)
        assert all(s.is_alive() for s in streams), "the streams ended before the kill: make LONG longer"
        killed = kill_serving_core(engine)
        kills.append(killed)
        status, body = http("POST", f"http://127.0.0.1:{engine.port}/v1/completions",
                            {"prompt": "Hi", "max_tokens": 1})
        kill_to_200.append((time.monotonic() - killed) * 1e3)
        assert status == 200, body
        for s, ref in zip(streams, reference):
            whole(s.result(), ref)
    assert engine.proc.poll() is None and len(READY.findall(engine.log())) == 1  # one front, never replaced
    assert "libtorch" not in Path(f"/proc/{engine.front_pid}/maps").read_text()  # the front holds no torch
    assert len(PROMOTED.findall(engine.log())) >= 3
    median = statistics.median(kill_to_200)
    print(f"kill -> next 200 (ms), each kill with 4 streams resuming: {[round(m, 1) for m in kill_to_200]}, "
          f"median {median:.1f}")
    # The front's timeline of each failover: its phases in order, the four streams (and perhaps the
    # fresh request, if it reached the dead core) re-added to the promoted one.
    timelines = [json.loads(m) for m in TIMELINE.findall(engine.log())]
    assert len(timelines) == 3, engine.log()[-2000:]
    for t in timelines:
        marks = [t[k] for k in ("death_seen", "channel_closed", "spare_taken", "requests_sent", "first_output")]
        assert marks == sorted(marks) and 4 <= t["resumed"] <= 5, t
        print("phases (ms):", {k: round((b - a) * 1e3, 1) for k, a, b in zip(
            ("channel ended", "promote", "re-add", "first tokens"), marks, marks[1:])})
    # From this process's kill to the front's knowing: the core's owner-death mutex wakes the front
    # as the core dies (core/owner_death.py), before the kernel has torn it down (30 to 70 ms here
    # for the channel's end alone, before the mutex).
    print("kill -> death seen (ms):", [round((t["death_seen"] - k) * 1e3, 1) for t, k in zip(timelines, kills)])
    # Seen before the channel ended (the mutex woke the front, which then ended the channel; without
    # the mutex the two are one moment, the reader's).
    assert all(t["death_seen"] < t["channel_closed"] for t in timelines), timelines
    # The CPU target (KILL_TO_200_MS) is reported, not asserted: on this shared 2-core host the
    # median of 3 went from 43 to 61 ms between two runs of the same code (the fresh request shares its
    # first steps with the four resumed streams), so an assert would test the host's load.
    print(f"target {KILL_TO_200_MS:g} ms: {'met' if median <= KILL_TO_200_MS else 'not met'} in this run")


def test_a_core_idle_longer_than_the_heartbeat_timeout_is_not_taken_for_hung(engine):
    """An idle core sends nothing (report_status beats only while requests run), so the silence the
    watch measures counts from the work given to it. The break it catches: counting from the core's
    last frame killed a healthy core as hung at the first request after an idle spell longer than
    --respawn-heartbeat-timeout (found by the four-streams test, whose third kill then hit the spare)."""
    assert http("POST", f"http://127.0.0.1:{engine.port}/v1/completions", {"prompt": "Hi", "max_tokens": 2})[0] == 200
    time.sleep(HEARTBEAT_TIMEOUT_S + 1.0)  # idle: no frame from the core
    stream = Stream(engine.port, {"prompt": "Hello", "max_tokens": 200, "ignore_eos": True})
    assert stream.result()[-1] == "[DONE]"
    time.sleep(0.5)  # a few of the watch's beats after the end
    assert not HUNG.search(engine.log()) and not PROMOTED.search(engine.log()), engine.log()[-1500:]


KV_ALLOCATED = re.compile(r"KV cache: \d+ sequence\(s\) of \d+ tokens allocated")


def test_a_spare_allocates_its_kv_cache_only_once_promoted(engine):
    # Two KV caches, each sized to the free memory, do not fit a GPU: the spare waits without one.
    wait_spare(engine)
    log = engine.log()
    spare = int(SPARE_READY.findall(log)[-1])
    assert f"Spare engine core pid {spare} prepared in " in log and "no KV cache until its promotion" in log
    assert len(KV_ALLOCATED.findall(log)) == 1, log[-2000:]  # the serving core's alone
    kill_serving_core(engine)
    engine.wait_for(lambda: PROMOTED.search(engine.log()), 60, "the promotion")
    log = engine.log()
    kv = [m.start() for m in KV_ALLOCATED.finditer(log)]
    assert len(kv) == 2, log[-2000:]
    # Its Promote, then its KV cache, then the front's word that it serves: in the order they happened.
    assert log.index(f"Spare engine core pid {spare} promoted: sizing") < kv[1] \
        < log.index(f"Engine core pid {spare} promoted "), log[-2000:]


def test_a_seeded_sampled_stream_resumed_is_its_uncrashed_run(engine):
    body = {"prompt": "Once upon a time", "max_tokens": LONG, "ignore_eos": True, "temperature": 1.0, "seed": 7}
    reference = Stream(engine.port, body).result()
    wait_spare(engine)
    s = Stream(engine.port, body)
    assert s.started_.wait(60) and s.is_alive()
    kill_serving_core(engine)
    whole(s.result(), reference)


def test_a_chat_stream_and_a_whole_answer_in_flight_complete_counting_tokens_once(engine):
    messages = [{"role": "user", "content": "Tell me a story"}]
    chat = {"messages": messages, "max_tokens": LONG, "ignore_eos": True, "stream_options": {"include_usage": True}}
    url = f"http://127.0.0.1:{engine.port}/v1/completions"
    plain = {"prompt": "The cat", "max_tokens": LONG, "ignore_eos": True}
    chat_ref = Stream(engine.port, chat, "/v1/chat/completions").result()
    plain_ref = http("POST", url, plain)[1]
    wait_spare(engine)
    answers = []
    t = threading.Thread(target=lambda: answers.append(http("POST", url, plain, timeout=120)), daemon=True)
    t.start()
    s = Stream(engine.port, chat, "/v1/chat/completions")
    assert s.started_.wait(60) and s.is_alive()
    kill_serving_core(engine)
    events = s.result()
    whole(events, chat_ref, chat=True)
    usage = [e["usage"] for e in events if isinstance(e, dict) and e.get("usage")]
    assert usage and usage[-1]["completion_tokens"] == LONG, usage
    t.join(120)
    status, body = answers[0]
    assert status == 200, body
    assert body["choices"][0]["text"] == plain_ref["choices"][0]["text"]
    assert body["usage"]["completion_tokens"] == LONG


def test_a_stopped_core_is_killed_at_the_heartbeat_bound_and_its_stream_resumes(engine):
    body = {"prompt": "weights", "max_tokens": LONG, "ignore_eos": True}
    reference = Stream(engine.port, body).result()
    wait_spare(engine)
    s = Stream(engine.port, body)
    assert s.started_.wait(60) and s.is_alive()
    pid = serving_core(engine)
    stopped = time.monotonic()
    os.kill(pid, signal.SIGSTOP)
    whole(s.result(), reference)
    took = time.monotonic() - stopped
    hung = HUNG.findall(engine.log())
    assert hung and int(hung[-1][0]) == pid, engine.log()[-2000:]
    assert HEARTBEAT_TIMEOUT_S <= float(hung[-1][1]) < took
    assert serving_core(engine) != pid


# Timed: each kill must come within STABLE_S of the promotion before it, after the next spare has
# loaded; at a load average of 15 a spare took longer than that to load, and the row never formed.
@pytest.mark.timed
def test_repeated_deaths_give_up_and_the_front_exits_1(procs, tiny_model):
    e = procs.serve(tiny_model, "--max-model-len", "64", "--respawn").wait_for_log("Engine ready")
    e.first_core = int(READY.search(e.log()).group(2))
    for i in range(MAX_DEATHS):  # each soon after the promotion before it
        wait_spare(e)
        kill_serving_core(e)
        e.wait_for(lambda i=i: e.proc.poll() is not None or len(PROMOTED.findall(e.log())) > i, 60, "a promotion")
    assert e.exit_code(timeout=60) == 1, e.log()[-2000:]
    assert f"{MAX_DEATHS} deaths in a row, each within {STABLE_S:g} s of the promotion before it; giving up" \
        in e.log()
    assert len(PROMOTED.findall(e.log())) == MAX_DEATHS - 1


def test_more_than_one_rank_is_refused_naming_the_flag(tiny_model, wcache_env):
    r = run_cli("serve", str(tiny_model), "--device", "cpu", "--respawn", "--tensor-parallel-size", "2",
                env=wcache_env)
    assert r.returncode == 2, r.stderr
    assert "--respawn supports an engine of one rank; this one has 2 ranks (" in r.stderr, r.stderr
    assert "Spare engine core" not in r.stderr  # refused before any spare started


def gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1].startswith("Z")  # a zombie: ended
    except FileNotFoundError:
        return True


def test_sigterm_drains_then_stops_the_front_its_core_and_its_spare(engine):
    wait_spare(engine)
    core, spare = serving_core(engine), int(SPARE_READY.findall(engine.log())[-1])
    s = Stream(engine.port, {"prompt": "Hello", "max_tokens": 64, "ignore_eos": True}, after=1)
    assert s.started_.wait(60)
    os.kill(engine.pid, signal.SIGTERM)
    assert engine.exit_code(timeout=60) == 0, engine.log()[-2000:]
    events = s.result()
    assert events[-1] == "[DONE]" and not [e for e in events if isinstance(e, dict) and "error" in e]
    assert len(text_of(events)) > 0
    wait_until(lambda: gone(core) and gone(spare), 30, what="the core and the spare to end")
