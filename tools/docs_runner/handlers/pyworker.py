"""A page's Python interpreter: runs the page's python blocks in order, sharing their globals, with
pytest-examples' print check (``#>`` lines under a ``print``).

Started by handlers/python.py as a separate process, so an example's chdir, environment, imports
and ``__main__`` are its own, never the test process's. Requests come as JSON lines on stdin; each
answer is one JSON line on the descriptor named by DOCS_RUNNER_REPLY_FD (stdout and stderr are the
examples' own, and go to the page's log).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path


def describe(exc: BaseException) -> str:
    """Type, message and the last frames. pytest-examples re-points tracebacks at the markdown lines
    with synthetic frames that make traceback.format_exception raise on Python 3.11."""
    msg = getattr(exc, "msg", None)
    if type(exc).__name__ == "Failed" and msg:
        return str(msg)
    frames = []
    tb = exc.__traceback__
    while tb is not None:
        try:
            frames.append(f"  {tb.tb_frame.f_code.co_filename}:{tb.tb_lineno}")
        except Exception:  # noqa: BLE001 - a synthetic frame; keep what we can
            frames.append("  <frame>")
        tb = tb.tb_next
    return "Traceback (last frames):\n" + "\n".join(frames[-6:]) + f"\n{type(exc).__name__}: {exc}"


def main() -> int:
    from pytest_examples import CodeExample
    from pytest_examples.config import ExamplesConfig
    from pytest_examples.run_code import run_code

    reply = os.fdopen(int(os.environ.pop("DOCS_RUNNER_REPLY_FD")), "w")
    files = Path(tempfile.mkdtemp(prefix="docs-py-", dir=os.environ.pop("DOCS_RUNNER_FILES", None)))
    module_globals: dict = {}
    for line in sys.stdin:
        req = json.loads(line)
        answer = {"ok": True, "error": ""}
        try:
            os.chdir(req["cwd"])
            os.environ.clear()
            os.environ.update(req["env"])
            tempfile.tempdir = None  # TMPDIR is the page's
            example = CodeExample.create(req["source"], path=Path(req["path"]), start_line=req["line"],
                                         prefix="python")
            python_file = files / f"{example.module_name}.py"
            python_file.write_text(example.source)
            insert_print, module = run_code(example=example, python_file=python_file, loader=None,
                                            config=ExamplesConfig(), enable_print_mock=True, print_callback=None,
                                            include_print=None, module_globals=dict(module_globals), call=None)
            insert_print.check_print_statements(example)
            module_globals.update(module)
        except BaseException as e:  # noqa: BLE001 - reported to the runner, which fails the block
            answer = {"ok": False, "error": describe(e)}
        sys.stdout.flush()
        sys.stderr.flush()
        reply.write(json.dumps(answer) + "\n")
        reply.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
