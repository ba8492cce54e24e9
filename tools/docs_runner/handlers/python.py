"""Python blocks: run in one worker process per page (pyworker.py), in the page's current directory
and environment, sharing globals in page order, with pytest-examples' ``#>`` print check."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

WORKER = Path(__file__).with_name("pyworker.py")
#: Wall-clock limit of one python block.
BLOCK_TIMEOUT_S = 300.0


class PythonWorker:
    def __init__(self, log: Path) -> None:
        self.log = log
        self.proc: subprocess.Popen | None = None
        self.reply = None

    def start(self, cwd: Path, env: dict[str, str]) -> int:
        r, w = os.pipe()
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, str(WORKER)], cwd=cwd,
                # The blocks' files go beside the worker's output, the runner's, not in the page's TMPDIR.
                env={**env, "DOCS_RUNNER_REPLY_FD": str(w), "DOCS_RUNNER_FILES": str(self.log.parent)},
                stdin=subprocess.PIPE, stdout=out, stderr=subprocess.STDOUT, pass_fds=(w,),
                start_new_session=True, text=True,
            )
        os.close(w)
        self.reply = os.fdopen(r, "r")
        return self.proc.pid

    def run(self, source: str, page: Path, line: int, cwd: Path, env: dict[str, str]) -> str | None:
        """None when the block ran and its prints matched, else why not."""
        assert self.proc is not None and self.proc.stdin is not None and self.reply is not None
        req = {"source": source, "path": str(page), "line": line, "cwd": str(cwd), "env": env}
        try:
            self.proc.stdin.write(json.dumps(req) + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            return f"the page's Python worker exited ({self.proc.poll()}); see {self.log}"
        import selectors

        with selectors.DefaultSelector() as sel:
            sel.register(self.reply, selectors.EVENT_READ)
            if not sel.select(timeout=BLOCK_TIMEOUT_S):
                return f"timed out after {BLOCK_TIMEOUT_S:g}s"
        answer = self.reply.readline()
        if not answer:
            return f"the page's Python worker exited ({self.proc.wait()}); see {self.log}"
        result = json.loads(answer)
        return None if result["ok"] else result["error"]

    def close(self) -> None:
        if self.proc is not None and self.proc.stdin is not None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.reply.close()
