"""A chat template that never ends, or eats memory, is stopped at its deadline; the engine serves on
and still stops on SIGTERM within --shutdown-timeout (engine/openai/template_sandbox.py).

The template is the attack round's: two nested ``range(100000)`` loops, run only when the first
message says ``spin`` (so the same server also answers ordinary chats), and a 1 GB string when it
says ``grow``. Everything runs against a real `wcache serve`; the render workers are found as the
engine's children by their command line.
"""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path

import pytest
from procs import alive, children_running, complete, http, wait_until

TEMPLATE = (
    "{% if messages[0].content == 'spin' %}{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}"
    "{% endfor %}{% endif %}"
    "{% if messages[0].content == 'grow' %}{{ 'x' * (messages | length * 1000000000) }}{% endif %}"
    "{% for m in messages %}<|{{ m.role }}|>\n{{ m.content }}{{ eos_token }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def chat(port: int, content: str, timeout: float = 30) -> tuple[int, dict, float]:
    t0 = time.monotonic()
    status, body = http("POST", f"http://127.0.0.1:{port}/v1/chat/completions",
                        {"messages": [{"role": "user", "content": content}], "max_tokens": 4}, timeout=timeout)
    return status, body, time.monotonic() - t0


def workers(pid: int) -> list[int]:
    return children_running(pid, "wcache.engine.openai.template_worker")


def cpu_ticks(pid: int) -> int:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime + stime


@pytest.fixture
def template(tmp_path) -> Path:
    path = tmp_path / "spin.jinja"
    path.write_text(TEMPLATE)
    return path


def test_a_template_that_never_ends_gets_a_400_naming_it_at_the_deadline_and_stops_burning(procs, tiny_model,
                                                                                        template):
    serve = procs.serve(tiny_model, "--chat-template", str(template), "--chat-template-render-timeout", "2")
    status, body, seconds = chat(serve.port, "hello")
    assert status == 200, body

    status, body, seconds = chat(serve.port, "spin", timeout=20)
    assert status == 400 and body["error"]["message"] == (
        f"The chat template could not render these messages: {template}: rendering took longer than 2 s "
        "(--chat-template-render-timeout), so it was stopped"), body
    assert 2 <= seconds < 4, seconds
    # Nothing of it is left burning: every remaining worker is idle.
    before = {p: cpu_ticks(p) for p in workers(serve.pid)}
    time.sleep(1)
    assert all(cpu_ticks(p) - t <= 5 for p, t in before.items() if p in workers(serve.pid)), before

    status, body, _ = chat(serve.port, "grow")
    assert status == 400 and body["error"]["message"] == (
        f"The chat template could not render these messages: {template}: rendering needed more than 512 MiB of "
        "memory, so it was stopped"), body
    status, body, _ = chat(serve.port, "hello")  # a fresh worker renders the next one
    assert status == 200, body


@pytest.mark.timed  # a completion's time beside four spinning renders against alone: another worker's load skews it
def test_renders_that_burn_their_deadline_leave_a_completion_as_fast(procs, tiny_model, template):
    serve = procs.serve(tiny_model, "--chat-template", str(template), "--chat-template-render-timeout", "8")

    def timed() -> float:
        t0 = time.monotonic()
        complete(serve.port, max_tokens=16)
        return time.monotonic() - t0

    timed()
    alone = sorted(timed() for _ in range(5))[2]
    spinning = [threading.Thread(target=chat, args=(serve.port, "spin")) for _ in range(4)]
    for t in spinning:
        t.start()
    time.sleep(0.5)  # all four rendering
    assert len(workers(serve.pid)) >= 4
    beside = sorted(timed() for _ in range(5))[2]
    for t in spinning:
        t.join(30)
    print(f"completion alone {alone:.3f} s, beside 4 spinning renders {beside:.3f} s")
    # Was 10x (0.53 s to 5.3 s) while the renders held the engine's GIL; now they hold other
    # processes, niced: the allowance is for a shared, loaded CI machine.
    assert beside <= 1.5 * alone + 0.25, (alone, beside)


def test_sigterm_with_renders_in_flight_ends_the_engine_inside_the_shutdown_timeout(procs, tiny_model, template):
    serve = procs.serve(tiny_model, "--chat-template", str(template), "--chat-template-render-timeout", "60",
                        "--shutdown-timeout", "6")
    answers = []
    spinning = [threading.Thread(target=lambda: answers.append(chat(serve.port, "spin", timeout=60)))
                for _ in range(4)]
    for t in spinning:
        t.start()
    time.sleep(1)
    rendering = workers(serve.pid)
    assert len(rendering) >= 4
    t0 = time.monotonic()
    serve.proc.send_signal(signal.SIGTERM)
    serve.proc.wait(20)
    stopped = time.monotonic() - t0
    print(f"SIGTERM with 4 renders in flight: exited after {stopped:.1f} s (--shutdown-timeout 6)")
    assert stopped < 6 + 3.5, stopped  # the drain's deadline, then the engine's own stop on a loaded machine
    # The workers go with the engine (each watches its parent): none burns on as an orphan.
    wait_until(lambda: not any(alive(p) for p in rendering), 3, "the render workers to exit")
    for t in spinning:
        t.join(10)
