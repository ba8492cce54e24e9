"""One page's blocks, in order, in a working directory and environment of the page's own.

``TMPDIR`` (so wcache's default socket directory is private to the page), ``WCACHE_CACHE_ROOT``
and the current directory are fresh for each page; ``.venv/bin`` comes first on ``PATH``. Bash
blocks pass their environment and directory on to the page's next block, and python blocks run
in a worker process that starts from them. Nothing here changes this process's own environment,
directory or modules. Everything a page started is stopped when it ends.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from collections.abc import Iterable
from pathlib import Path

from . import ROOT, leftovers
from .coverage import RUN, SKIPPED, SUBSTITUTED, UNMARKED, VALIDATED, Recorder, disposition, gpu_mode, rewrites
from .handlers import bash, output, validate
from .handlers.python import PythonWorker
from .markers import MarkerError
from .parse import Block, display, extract_blocks
from .processes import TERM_GRACE_S, stop_sessions
from .substitutions import Substitution, apply_substitutions, load_substitutions

#: Set to 1 to keep each page's working directory after the page ends.
KEEP_ENV = "WCACHE_DOCS_KEEP"


class BlockFailure(AssertionError):
    """A block that ran or was validated and did not do what the guide says."""


class PageRunner:
    def __init__(
        self,
        page: Path,
        *,
        root: Path = ROOT,
        recorder: Recorder | None = None,
        extra_path: Iterable[Path] = (),
        extra_env: dict[str, str] | None = None,
        substitutions: list[Substitution] | None = None,
        grace: float = TERM_GRACE_S,
        gpu: bool | None = None,
        check_leftovers: bool = True,
    ) -> None:
        self.page = Path(page)
        self.check_leftovers = check_leftovers  # off only for the runner's own tests of other things
        self.root = Path(root)
        self.recorder = recorder
        self.extra_path = [Path(p) for p in extra_path]
        self.extra_env = dict(extra_env or {})
        self.gpu = gpu_mode() if gpu is None else gpu
        if substitutions is None:
            substitutions = [] if self.gpu else load_substitutions()
        self.substitutions = substitutions
        self.grace = grace
        self.sessions: set[int] = set()
        self.last_bash: tuple[Block, bash.BashResult] | None = None
        # An expect-fail YAML/JSON block's rejection: the expect-output block after it checks its text.
        self.rejection: tuple[Block, str] | None = None
        self.python: PythonWorker | None = None

    # -- setup / teardown ---------------------------------------------------------------------

    def _setup(self) -> None:
        # Short paths: Unix socket paths are limited to 107 bytes and TMPDIR holds the socket dir.
        self.dir = Path(tempfile.mkdtemp(prefix="wcb-", dir="/tmp" if Path("/tmp").is_dir() else None))
        self.cwd = self.dir / "work"
        self.logs = self.dir / "logs"
        self.state = self.dir / "state"
        for d in (self.cwd, self.dir / "tmp", self.logs, self.state):
            d.mkdir()
        path = [str(p) for p in self.extra_path] + [
            str(ROOT / ".venv" / "bin"),
            str(Path(sys.executable).parent),
            os.environ.get("PATH", "/usr/local/bin:/usr/bin:/bin"),
        ]
        self.env = {
            **os.environ,
            **self.extra_env,
            "TMPDIR": str(self.dir / "tmp"),
            # wcache's on-disk cache (fingerprint memo): cold and private for every page.
            "WCACHE_CACHE_ROOT": str(self.dir / "cache"),
            # The daemons' arena records (hand-back): the page's own, not the home directory's.
            "WCACHE_STATE_DIR": str(self.dir / "daemon-state"),
            "PATH": os.pathsep.join(path),
            "PYTHONUNBUFFERED": "1",
        }

    def teardown(self) -> list[str]:
        if self.python is not None:
            self.python.close()
        survivors = stop_sessions(self.sessions, self.grace)
        return [f"processes still alive after SIGKILL at teardown: {survivors}"] if survivors else []

    # -- the page -----------------------------------------------------------------------------

    def run(self) -> None:
        blocks = extract_blocks(self.page, self.root)
        self._setup()
        tmp_before = leftovers.tmp_entries()
        failure: str | None = None
        try:
            for i, block in enumerate(blocks):
                self.run_block(block, blocks[i + 1] if i + 1 < len(blocks) else None)
        except BlockFailure as e:
            failure = str(e)
        finally:
            problems = self.teardown()
        if failure is None and self.check_leftovers:  # a page that ran to its end leaves the reader's tree and /tmp as they were
            problems += leftovers.find(self.dir / "work", self.dir / "tmp", tmp_before,
                                       "\n".join(b.source for b in blocks))
        if failure is None and problems:
            failure = f"{display(self.page, self.root)}: " + "; ".join(problems)
        if os.environ.get(KEEP_ENV, "") in ("", "0"):
            shutil.rmtree(self.dir, ignore_errors=True)
        elif failure is not None:
            failure += f"\n(page working directory kept: {self.dir})"
        if failure is not None:
            raise BlockFailure(failure)

    def _record(self, block: Block, kind: str, detail: str = "") -> None:
        if self.recorder is not None:
            self.recorder.add(block, kind, detail)

    def _fail(self, block: Block, msg: str) -> None:
        self._record(block, "failed", msg.splitlines()[0] if msg else "")
        raise BlockFailure(f"{block.where} ({block.lang} block): {msg}")

    def run_block(self, block: Block, following: Block | None = None) -> None:
        kind, detail = disposition(block, self.gpu)
        if kind in (UNMARKED, SKIPPED):
            self._record(block, kind, detail)  # an unmarked block fails the coverage test, not the page
            return
        expect_fail = bool(block.marker and block.marker.has("expect-fail"))
        if not (block.marker and block.marker.has("expect-output")):
            self.rejection = None
        if expect_fail and block.lang in ("yaml", "json") and not (
                following is not None and following.marker and following.marker.has("expect-output")):
            self._fail(block, "an expect-fail YAML/JSON block must be followed by an expect-output block with the "
                              "rejection it shows (any rejection, a parse error included, would pass otherwise)")
        if block.lang == "bash":
            if self.run_bash(block, expect_fail):
                self._record(block, SUBSTITUTED, "bash, " + ", ".join(rewrites(block, self.substitutions, self.gpu)))
            else:
                self._record(block, RUN, "bash")
        elif block.lang == "python":
            self.run_python(block)
            self._record(block, RUN, "python")
        elif block.lang == "yaml":
            self._check_validation(block, *validate.validate_yaml(block.source), expect_fail)
        elif block.lang == "json":
            loader = bool(block.marker and block.marker.has("loader-config"))
            self._check_validation(block, *validate.validate_json(block.source, loader), expect_fail)
        else:  # expect-output: disposition() leaves nothing else
            self.check_output(block)
            self._record(block, VALIDATED, "expect-output")

    def _check_validation(self, block: Block, errors: list[str], what: str, expect_fail: bool) -> None:
        src = f" (from {', '.join(block.includes)})" if block.includes else ""
        if expect_fail and not errors:
            self._fail(block, f"marked expect-fail but {what}{src} accepted it")
        if errors and not expect_fail:
            self._fail(block, f"{what}{src} rejected it:\n  " + "\n  ".join(errors))
        if expect_fail:
            self.rejection = (block, "\n".join(errors))
        self._record(block, VALIDATED, what + src)

    # -- bash ---------------------------------------------------------------------------------

    def run_bash(self, block: Block, expect_fail: bool) -> bool:
        """Run a bash block as the reader would; whether a substitution rewrote it first."""
        problem = bash.check_pasteable(block.source, expect_fail)
        if problem:
            self._fail(block, problem)
        applied = self.recorder.substitutions_applied if self.recorder is not None else None
        script = apply_substitutions(block.source, self.substitutions, applied)
        timeout = float(block.marker.attrs["timeout"]) if block.marker and "timeout" in block.marker.attrs \
            else bash.BLOCK_TIMEOUT_S
        result = bash.run_bash(script, tag=f"b{block.index + 1:02d}-L{block.line}", cwd=self.cwd, env=self.env,
                               state=self.state, logs=self.logs, sessions=self.sessions, timeout=timeout)
        self.env, self.cwd = bash.load_state(self.state, self.env, self.cwd)
        self.last_bash = (block, result)
        if result.rc is None:
            self._fail(block, f"timed out after {timeout:g}s\n{self._output_tail()}")
        if expect_fail and result.rc == 0:
            self._fail(block, f"marked expect-fail but exited 0\n{self._output_tail()}")
        if not expect_fail and result.rc != 0:
            self._fail(block, f"exited {result.rc}\n{self._output_tail()}")
        return script != block.source

    def _sources(self) -> list[tuple[str, str]]:
        assert self.last_bash is not None
        block, result = self.last_bash
        sources = [(f"output of the bash block at {block.where}", result.output)]
        sources += [(f"log {log.name} of a background command", log) for log in result.logs]
        out = []
        for name, path in sources:
            try:
                out.append((name, Path(path).read_text(encoding="utf-8", errors="replace")))
            except OSError:
                out.append((name, ""))
        return out

    def _output_tail(self, n: int = 40) -> str:
        parts = []
        for name, text in self._sources():
            lines = text.splitlines()
            parts.append(f"--- {name} (last {min(n, len(lines))} lines)\n" + "\n".join(lines[-n:]))
        return "\n".join(parts)

    def check_output(self, block: Block) -> None:
        if self.rejection is not None:
            rejected, text = self.rejection
            self.rejection = None
            problem = output.match_output(block.source, [(f"rejection of the {rejected.lang} block at "
                                                          f"{rejected.where}", text)])
            if problem:
                self._fail(block, problem)
            return
        if self.last_bash is None:
            self._fail(block, "expect-output block, but no bash block ran before it on this page")
        ran = self.last_bash[0]
        sources = self._sources()
        problem = output.match_output(block.source, sources,
                                      error_levels=bool(ran.marker and ran.marker.has("expect-fail")))
        if problem is None and block.marker is not None and block.marker.has("whole-output"):
            printed = [ln for ln in sources[0][1].splitlines() if ln.strip()]
            shown = [ln for ln in block.source.splitlines() if ln.strip()]
            if len(printed) != len(shown):
                problem = (f"marked whole-output, but the block printed {len(printed)} line(s) and the page shows "
                           f"{len(shown)}: a reader sees lines the page leaves out\n" + "\n".join(printed))
        if problem:
            self._fail(block, problem)

    # -- python -------------------------------------------------------------------------------

    def run_python(self, block: Block) -> None:
        if self.python is None:
            self.python = PythonWorker(self.logs / "python.out")
            self.sessions.add(self.python.start(self.cwd, self.env))
        error = self.python.run(block.source, block.page, block.line, self.cwd, self.env)
        if error is not None:
            self._fail(block, error)


def run_page(page: Path | str, **kwargs) -> None:
    """Run one page inside a pytest test; a failing block fails the test with a plain message
    (pytest.fail outside any ``except`` block: failing inside exception handling has ended in
    INTERNALERROR with pytest-examples on Python 3.11)."""
    import pytest

    failure: str | None = None
    try:
        PageRunner(Path(page), **kwargs).run()
    except (BlockFailure, MarkerError) as e:
        failure = str(e)
    if failure is not None:
        pytest.fail(failure, pytrace=False)
