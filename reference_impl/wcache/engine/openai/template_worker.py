"""The render worker: a process that compiles and renders chat templates for the engine, one at a time.

Started by engine/openai/template_sandbox.py, which says why; this side reads one JSON request a line on
stdin and writes one JSON answer a line on stdout, inside the limits it sets on itself first.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import threading
import time

from wcache.core import no_dump
from wcache.engine.openai import chat_template  # jinja2 and the standard library: no torch
from wcache.engine.openai.template_sandbox import RENDER_MEMORY_BYTES


def serve() -> int:
    no_dump.forbid()  # it sees the requests' messages
    os.nice(10)  # a render that burns its whole deadline yields the CPU to the engine's own threads
    _lower(resource.RLIMIT_AS, RENDER_MEMORY_BYTES)
    # Not PR_SET_PDEATHSIG, which the kernel sends when the *thread* that started the worker ends
    # (request threads end all the time): a thread that watches for the engine's death, which runs
    # while a render holds the GIL (the interpreter switches threads every few milliseconds).
    threading.Thread(target=_exit_with_parent, args=(os.getppid(),), daemon=True).start()
    compiled = {}
    for line in sys.stdin.buffer:
        request = json.loads(line)
        used = resource.getrusage(resource.RUSAGE_SELF)
        cpu = int(used.ru_utime + used.ru_stime + request["timeout_s"]) + 2
        _lower(resource.RLIMIT_CPU, cpu, keep_hard=True)  # SIGXCPU past it
        try:
            key = (request["text"], request["source"])
            if key not in compiled:
                compiled = {key: chat_template.compile_template(*key)}
            answer = {"rendered": chat_template.render_compiled(compiled[key], request["variables"])}
        except MemoryError:
            answer = {"memory": True}
        except (chat_template.RenderError, chat_template.ChatTemplateError) as e:
            answer = {"error": str(e)}
        sys.stdout.buffer.write(json.dumps(answer).encode() + b"\n")
        sys.stdout.buffer.flush()
    return 0


def _lower(limit: int, soft: int, keep_hard: bool = False) -> None:
    """Set ``limit``'s soft value (never above its hard one); the hard one too unless ``keep_hard``
    (the CPU limit moves up again before each render)."""
    _, hard = resource.getrlimit(limit)
    soft = soft if hard == resource.RLIM_INFINITY else min(soft, hard)
    resource.setrlimit(limit, (soft, hard if keep_hard else soft))


def _exit_with_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(0.2)
    os._exit(0)


if __name__ == "__main__":
    sys.exit(serve())
