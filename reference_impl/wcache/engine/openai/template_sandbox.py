"""Chat templates render in small child processes, each render under a deadline and a memory bound.

A chat template is untrusted code that comes with a checkpoint. jinja2's sandbox keeps it away from
Python's internals, but not from time and memory: two nested ``range(100000)`` loops or a 1 GB
string render for as long as they like, and a render in a thread of the engine cannot be stopped
(a thread cannot be killed), holds the GIL the engine's own threads need, and outlives its client
and a SIGTERM's drain. So the engine never renders a template itself: a render worker does, a
fresh interpreter (``python -m wcache.engine.openai.template_worker``, jinja2 and the standard library,
no torch) whose address space is capped (``RLIMIT_AS``, ``RENDER_MEMORY_BYTES``). A render that
runs past ``--chat-template-render-timeout`` is stopped by killing its worker (SIGKILL: its CPU
and memory are gone at once); one that needs more memory fails inside the worker with
MemoryError, and that worker is replaced too. Either way the request gets a 400 naming the
template, and the next render gets a fresh worker.

Requests and answers cross a pipe as one line of JSON each (never pickle): the template's text and
source, and the variables, which are JSON already (the request's messages and
``chat_template_kwargs``). Up to ``MAX_WORKERS`` render at once, each a process started on first
need and kept for the next render; a request that finds all busy waits for one.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import threading
import time

DEFAULT_TIMEOUT_S = 5.0  # a normal template renders in milliseconds
RENDER_MEMORY_BYTES = 512 << 20  # the worker's whole address space: interpreter, jinja2 and the render
MAX_ANSWER_BYTES = 64 << 20  # a rendered prompt longer than this is no prompt a model takes
MAX_WORKERS = 4

TIMED_OUT = "{source}: rendering took longer than {timeout:g} s (--chat-template-render-timeout), so it was stopped"
OUT_OF_MEMORY = "{source}: rendering needed more than {mib} MiB of memory, so it was stopped"
TOO_LONG = "{source}: the rendered prompt is longer than {mib} MiB"
WORKER_DIED = "{source}: the render worker exited ({code}) before answering"
CUT = "{source}: the render was stopped: the server is shutting down (--shutdown-timeout passed)"


class SandboxError(Exception):
    """A render stopped by a limit, or a worker that died; str() names the template and the limit."""


class _Worker:
    def __init__(self):
        self.proc = subprocess.Popen([sys.executable, "-m", "wcache.engine.openai.template_worker"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, close_fds=True)
        self.buffer = b""

    def ask(self, request: dict, deadline: float) -> dict | None:
        """The worker's answer, or None at the deadline (the caller kills it)."""
        try:
            self.proc.stdin.write(json.dumps(request).encode() + b"\n")
            self.proc.stdin.flush()
        except OSError:  # it died while idle (the OOM killer, a stray signal): not this request's doing
            return {"died": self.proc.wait(), "idle": True}
        out = self.proc.stdout.fileno()
        while b"\n" not in self.buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([out], [], [], left)[0]:
                return None
            chunk = os.read(out, 1 << 20)
            if not chunk:
                return {"died": self.proc.wait()}
            self.buffer += chunk
            if len(self.buffer) > MAX_ANSWER_BYTES + 1024:
                return {"too_long": True}
        line, self.buffer = self.buffer.split(b"\n", 1)
        return json.loads(line)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                f.close()
            except OSError:  # a request still buffered for a worker that is gone
                pass


class RenderRunner:
    """The engine's side: a few render workers, and the deadline each render gets."""

    def __init__(self, timeout_s: float = DEFAULT_TIMEOUT_S, max_workers: int = MAX_WORKERS):
        self.timeout_s = timeout_s
        self._idle: list[_Worker] = []
        self._busy: set[_Worker] = set()
        self._cut = False
        self._free = threading.Semaphore(max_workers)
        self._lock = threading.Lock()

    def render(self, text: str, source: str, variables: dict) -> str:
        """The rendered template; SandboxError with the template's own refusal (its
        ``raise_exception``, a sandbox refusal) or the limit that stopped it."""
        answer = self._ask({"text": text, "source": source, "variables": variables})
        if "error" in answer:
            raise SandboxError(answer["error"])
        return answer["rendered"]

    def _ask(self, request: dict) -> dict:
        source = request["source"]
        with self._free:
            with self._lock:
                worker = self._idle.pop() if self._idle else None
            worker = worker or _Worker()
            answer = self._ask_one(worker, request)
            if answer is not None and answer.get("idle"):  # a worker that died idle: a fresh one, once
                worker.kill()
                worker = _Worker()
                answer = self._ask_one(worker, request)
            if self._cut:
                worker.kill()
                raise SandboxError(CUT.format(source=source))
            if answer is None or "died" in answer or "too_long" in answer or answer.get("memory"):
                worker.kill()
                if answer is None:
                    raise SandboxError(TIMED_OUT.format(source=source, timeout=self.timeout_s))
                if "died" in answer:
                    raise SandboxError(WORKER_DIED.format(source=source, code=answer["died"]))
                if "too_long" in answer:
                    raise SandboxError(TOO_LONG.format(source=source, mib=MAX_ANSWER_BYTES >> 20))
                raise SandboxError(OUT_OF_MEMORY.format(source=source, mib=RENDER_MEMORY_BYTES >> 20))
            with self._lock:
                self._idle.append(worker)
        return answer

    def _ask_one(self, worker: _Worker, request: dict) -> dict | None:
        with self._lock:
            self._busy.add(worker)
        try:
            return worker.ask({**request, "timeout_s": self.timeout_s}, time.monotonic() + self.timeout_s)
        finally:
            with self._lock:
                self._busy.discard(worker)

    def cut(self) -> None:
        """A SIGTERM's drain passed its deadline (engine/api_server/drain.py): stop every render in flight now,
        so its request answers and leaves instead of holding the engine's exit."""
        with self._lock:
            self._cut = True
            busy = list(self._busy)
        for w in busy:
            w.proc.kill()  # its ask() sees the pipe close; its request thread reaps it


RUNNER = RenderRunner()  # the process's one pool; served.py sets its deadline from the flag
