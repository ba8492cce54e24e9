"""The render runner (engine/openai/template_sandbox.py) with real worker processes, without an engine:
its limits, a worker that dies while idle, and a worker that imports no torch."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
from wcache.engine.openai import template_sandbox
from wcache.engine.openai.template_sandbox import RenderRunner, SandboxError

MESSAGES = {"messages": [{"role": "user", "content": "hi"}]}
SPIN = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"


@pytest.fixture
def runner():
    r = RenderRunner(timeout_s=1.0, max_workers=2)
    yield r
    r.cut()
    for w in r._idle:
        w.kill()


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in "ZX"
    except OSError:
        return False


def test_a_render_past_its_deadline_is_stopped_and_its_worker_killed(runner):
    assert runner.render("{{ messages[0].content }}", "t", MESSAGES) == "hi"
    [worker] = runner._idle
    t0 = time.monotonic()
    with pytest.raises(SandboxError) as e:
        runner.render(SPIN, "spin.jinja", MESSAGES)
    assert 1.0 <= time.monotonic() - t0 < 2.0
    assert str(e.value) == template_sandbox.TIMED_OUT.format(source="spin.jinja", timeout=1.0)
    assert not alive(worker.proc.pid)  # the worker that rendered it is gone, with its CPU and memory
    assert runner.render("{{ messages[0].content }}", "t", MESSAGES) == "hi"  # a fresh worker


def test_a_render_past_its_memory_is_stopped(runner):
    with pytest.raises(SandboxError) as e:
        runner.render("{{ 'x' * (messages | length * 1000000000) }}", "grow.jinja", MESSAGES)
    assert str(e.value) == template_sandbox.OUT_OF_MEMORY.format(source="grow.jinja", mib=512)


def test_a_worker_that_died_while_idle_is_replaced_without_failing_the_request(runner):
    assert runner.render("{{ messages[0].content }}", "t", MESSAGES) == "hi"
    [worker] = runner._idle
    os.kill(worker.proc.pid, signal.SIGKILL)
    worker.proc.wait()
    assert runner.render("{{ messages[0].content }}", "t", MESSAGES) == "hi"


def test_the_template_s_own_refusal_comes_back_as_its_text(runner):
    with pytest.raises(SandboxError) as e:
        runner.render("{{ raise_exception('only user messages') }}", "t", MESSAGES)
    assert str(e.value) == "only user messages"


def test_a_worker_imports_no_torch(runner):
    runner.render("{{ messages[0].content }}", "t", MESSAGES)
    [worker] = runner._idle
    assert "torch" not in Path(f"/proc/{worker.proc.pid}/maps").read_text()
