"""Bash blocks: the block's text, as shown, run by ``bash`` in a session of its own.

The only text changes are the declared substitutions (tools/substitutions.yaml, printed in the
summary, off in GPU mode). Around the block the runner adds strict mode (``set -euo pipefail``,
``set -a`` so assignments carry over), job control (``set -m``, as in an interactive terminal) and,
on exit, a note of the environment and the current
directory, which the page's next block starts from. Background jobs (``cmd &``) stay in the block's
session and run on after it; the page stops every process of its blocks' sessions when it ends
(processes.py).
"""

from __future__ import annotations

import dataclasses
import subprocess
from pathlib import Path

from ..processes import stop_sessions
from ..shell import background_logs, foreground_servers

#: Default wall-clock limit of one bash block (the ``timeout="N"`` marker sets another).
BLOCK_TIMEOUT_S = 300.0

PRELUDE = r"""# --- docs runner: strict mode, and the state the page's next block starts from ---
set -euo pipefail
__docs_runner_exit() {
  __docs_runner_rc=$?
  env -0 > "$DOCS_RUNNER_STATE/env" 2>/dev/null || true
  pwd > "$DOCS_RUNNER_STATE/cwd" 2>/dev/null || true
  exit "$__docs_runner_rc"
}
trap __docs_runner_exit EXIT
set -a
# Job control, as in the reader's terminal: each background job is a process group of its own, so
# `kill -- -$PID` stops a launcher with its ranks and `kill %1` works within the block.
set -m
# --- the block, as shown on the page ---
"""

#: Shell bookkeeping that does not carry over from one block to the next.
NOT_CARRIED = {"PWD", "OLDPWD", "SHLVL", "_", "__docs_runner_rc"}

FOREGROUND = (
    "{line!r} runs in the foreground: pasted into a terminal it never returns. Start it in the"
    " background with its output in a log file (`... > engine.log 2>&1 &`) and wait for it with"
    " `wcache wait --health URL` or `wcache wait --log FILE` (docs/contributing.md)"
)


@dataclasses.dataclass
class BashResult:
    rc: int | None  # None: timed out (and stopped)
    output: Path  # the block's stdout and stderr
    logs: list[Path]  # files its background commands write to
    timeout: float


def check_pasteable(script: str, expect_fail: bool) -> str | None:
    """Why a block would hang a pasting reader's terminal, or None."""
    if expect_fail:  # a refused start returns at once: that is what such a block shows
        return None
    lines = foreground_servers(script)
    return FOREGROUND.format(line=lines[0]) if lines else None


def run_bash(script: str, *, tag: str, cwd: Path, env: dict[str, str], state: Path, logs: Path,
             sessions: set[int], timeout: float = BLOCK_TIMEOUT_S) -> BashResult:
    script_file = state / f"{tag}.sh"
    script_file.write_text(PRELUDE + script, encoding="utf-8")
    out_file = logs / f"{tag}.out"
    with open(out_file, "wb") as out:
        proc = subprocess.Popen(["bash", str(script_file)], cwd=cwd, env={**env, "DOCS_RUNNER_STATE": str(state)},
                                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    sessions.add(proc.pid)
    try:
        rc: int | None = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        stop_sessions({proc.pid}, 2.0)
        proc.wait()
        rc = None
    return BashResult(rc, out_file, [cwd / p for p in background_logs(script)], timeout)


def load_state(state: Path, env: dict[str, str], cwd: Path) -> tuple[dict[str, str], Path]:
    """The environment and directory a block left, for the page's next block."""
    env_file, cwd_file = state / "env", state / "cwd"
    if env_file.exists():
        new = {}
        for item in env_file.read_bytes().split(b"\0"):
            k, sep, v = item.decode(errors="surrogateescape").partition("=")
            if sep and k not in NOT_CARRIED and not k.startswith(("__docs_runner", "DOCS_RUNNER_")):
                new[k] = v
        if new:
            env = new
        env_file.unlink()
    if cwd_file.exists():
        left = Path(cwd_file.read_text().strip())
        if left.is_dir():
            cwd = left
        cwd_file.unlink()
    return env, cwd
