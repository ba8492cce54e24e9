"""Tests of the block runner itself (tools/docs_runner), on tiny markdown pages written to tmp_path.

Everything here is real: bash runs, processes start and are killed, schemas validate. A stand-in
`wcache` script (a few lines of Python) plays preload/serve so that the real `wcache wait` can wait
for it as the guide's pages do; one smoke test uses the real `wcache` when it is installed.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from tools.docs_runner import ROOT
from tools.docs_runner.handlers.output import match_output
from tools.docs_runner.coverage import SUBSTITUTED, Recorder, coverage, disposition, format_summary
from tools.docs_runner.markers import MarkerError
from tools.docs_runner.page import BlockFailure, PageRunner, run_page
from tools.docs_runner.parse import extract_blocks
from tools.docs_runner.processes import alive
from tools.docs_runner.shell import background_logs, foreground_servers, logical_lines
from tools.docs_runner.substitutions import load_substitutions


def write_page(tmp_path: Path, text: str, name: str = "page.md") -> Path:
    page = tmp_path / name
    page.write_text(textwrap.dedent(text).lstrip(), encoding="utf-8")
    return page


def run(tmp_path: Path, text: str, **kwargs) -> PageRunner:
    """Run a page through PageRunner (BlockFailure propagates); fast teardown grace. What the page
    leaves behind is checked only where a test asks (check_leftovers=True): these pages test other things."""
    kwargs.setdefault("check_leftovers", False)
    runner = PageRunner(write_page(tmp_path, text), root=tmp_path, grace=3.0, **kwargs)
    runner.run()
    return runner


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- extraction and markers ------------------------------------------------------------------


def test_extracts_fences_at_any_indent_with_markers(tmp_path: Path) -> None:
    page = write_page(
        tmp_path,
        """
        # Page

        <!-- block: skip reason="GPU-only: needs a CUDA device" -->
        ```bash
        nvidia-smi
        ```

        !!! note "Inside an admonition"

            <!-- block: expect-output -->
            ~~~text
            hello
            ~~~

        === "Tab"

            ```{.python title="x.py"}
            print(1)
            ```

        ````markdown
        ```bash
        not a block of its own
        ```
        ````

        === "Terminal 1"

            Text in a tab, then a marked fence after a blank line.

            <!-- block: skip reason="in a second tab" -->

            ```bash
            echo tab
            ```

        1. A step:

            ```bash
            echo step
            ```
        """,
    )
    found = extract_blocks(page, tmp_path)
    assert [(b.line, b.lang) for b in found] == [
        (4, "bash"), (11, "text"), (17, "python"), (21, "markdown"), (33, "bash"), (39, "bash")]
    assert found[0].marker.reason == "GPU-only: needs a CUDA device"
    assert found[1].marker.has("expect-output") and found[1].body == "hello\n"
    assert found[2].body == "print(1)\n"
    assert "not a block of its own" in found[3].body
    assert found[4].marker.reason == "in a second tab" and found[4].body == "echo tab\n"
    assert found[5].marker is None and found[5].body == "echo step\n"
    assert disposition(found[0], gpu=False) == ("skipped", "GPU-only: needs a CUDA device")
    assert disposition(found[0], gpu=True) == ("run", "bash")
    assert disposition(found[3])[0] == "unmarked"


@pytest.mark.parametrize(
    "marker, message",
    [
        ("<!-- block: skip -->", "needs a non-empty reason"),
        ('<!-- block: skip reason="" -->', "needs a non-empty reason"),
        ('<!-- block: illustration reason="  " -->', "needs a non-empty reason"),
        ("<!-- block: skipp -->", "unknown marker word 'skipp'"),
        ('<!-- block: skip reason="x" expect-fail -->', "cannot be combined"),
        ("<!-- block: loader-config -->", "does not apply to a bash block"),
        ('<!-- block: expect-fail colour="red" -->', "unknown marker attribute 'colour'"),
    ],
)
def test_bad_markers_are_rejected(tmp_path: Path, marker: str, message: str) -> None:
    page = write_page(tmp_path, f"# P\n\n{marker}\n```bash\necho hi\n```\n")
    with pytest.raises(MarkerError, match=message):
        extract_blocks(page, tmp_path)


def test_indented_code_is_rejected_but_admonition_bodies_are_not(tmp_path: Path) -> None:
    ok = write_page(
        tmp_path,
        """
        # P

        !!! note "A note"

            Text inside the note.

            ```bash
            echo hi
            ```

        === "Tab"

            Text in a tab.

            ??? tip "Nested"

                More text.

        - item

            continued item paragraph

            - nested item
        """,
    )
    assert len(extract_blocks(ok, tmp_path)) == 1
    bad = write_page(tmp_path, "# P\n\nParagraph.\n\n    indented code\n", name="bad.md")
    with pytest.raises(MarkerError, match="bad.md:5: indented code block"):
        extract_blocks(bad, tmp_path)


def test_orphan_marker_and_unclosed_fence_are_rejected(tmp_path: Path) -> None:
    page = write_page(tmp_path, '# P\n\n<!-- block: skip reason="x" -->\n\nSome text.\n')
    with pytest.raises(MarkerError, match="not followed by a fenced block"):
        extract_blocks(page, tmp_path)
    page = write_page(tmp_path, "# P\n\n```bash\necho hi\n", name="open.md")
    with pytest.raises(MarkerError, match="open.md:3: fence ``` is never closed"):
        extract_blocks(page, tmp_path)


def test_skip_without_reason_fails_the_page_test(tmp_path: Path) -> None:
    page = write_page(tmp_path, "# P\n\n<!-- block: skip -->\n```bash\necho hi\n```\n")
    with pytest.raises(pytest.fail.Exception, match="needs a non-empty reason"):
        run_page(page, root=tmp_path)


def test_unmarked_console_block_is_counted_unmarked(tmp_path: Path) -> None:
    text = """
    # P

    ```bash
    echo hi
    ```

    ```console
    hi
    ```

    <!-- block: illustration reason="what a log looks like" -->
    ```log
    anything
    ```
    """
    recorder = Recorder()
    run(tmp_path, text, recorder=recorder)
    assert [r.kind for r in recorder.results] == ["run", "unmarked", "skipped"]
    cov = coverage(extract_blocks(tmp_path / "page.md", tmp_path))
    assert cov["unmarked"] == ["page.md:7 (console block without a marker)"]
    assert cov["skipped_reasons"] == {"illustration: what a log looks like": 1}
    assert "unmarked 1" in format_summary(extract_blocks(tmp_path / "page.md", tmp_path))


# --- bash --------------------------------------------------------------------------------------


def test_bash_blocks_share_state_in_order(tmp_path: Path) -> None:
    text = f"""
    # P

    ```bash
    GREETING=hello
    echo data > file.txt
    mkdir sub && cd sub
    ```

    ```sh
    test "$GREETING" = hello
    test "$(basename "$PWD")" = sub
    cat ../file.txt
    case "$TMPDIR" in /tmp/wcb-*/tmp) ;; *) echo "TMPDIR=$TMPDIR"; exit 1;; esac
    test "${{PATH%%:*}}" = "{ROOT}/.venv/bin"
    python -c 'import tempfile, os; assert tempfile.gettempdir() == os.environ["TMPDIR"]'
    ```

    ```python
    import os
    import tempfile

    print(os.path.basename(os.getcwd()), tempfile.gettempdir() == os.environ["TMPDIR"], os.environ["GREETING"])
    #> sub True hello
    ```
    """
    run(tmp_path, text)


def test_gpu_only_blocks_run_in_gpu_mode(tmp_path: Path) -> None:
    text = f"""
    # P

    <!-- block: skip reason="GPU-only: needs a CUDA device" -->
    ```bash
    echo wcache serve ./m --device cuda > {tmp_path}/ran
    ```
    """
    run(tmp_path, text, gpu=False)
    assert not (tmp_path / "ran").exists()
    run(tmp_path, text, gpu=True)
    assert (tmp_path / "ran").read_text() == "wcache serve ./m --device cuda\n"  # no substitution


def test_failing_bash_block_fails(tmp_path: Path) -> None:
    text = """
    # P

    ```bash
    echo before
    false
    echo after
    ```
    """
    with pytest.raises(BlockFailure, match=r"page.md:3 \(bash block\): exited 1") as e:
        run(tmp_path, text)
    assert "before" in str(e.value) and "after" not in str(e.value)


def test_pipefail_and_expect_fail(tmp_path: Path) -> None:
    with pytest.raises(BlockFailure, match="exited 1"):
        run(tmp_path, "# P\n\n```bash\nfalse | true\n```\n")
    text = """
    # P

    <!-- block: expect-fail -->
    ```bash
    echo "Error: no such model" >&2
    exit 3
    ```

    <!-- block: expect-output -->
    ```text
    Error: no such model
    ```
    """
    run(tmp_path, text)
    with pytest.raises(BlockFailure, match="marked expect-fail but exited 0"):
        run(tmp_path, "# P\n\n<!-- block: expect-fail -->\n```bash\ntrue\n```\n")


def test_failure_through_pytest_is_a_plain_fail(tmp_path: Path) -> None:
    page = write_page(tmp_path, "# P\n\n```bash\nexit 7\n```\n")
    with pytest.raises(pytest.fail.Exception, match="exited 7"):
        run_page(page, root=tmp_path)


def test_expect_output_in_order_with_log_prefixes(tmp_path: Path) -> None:
    good = """
    # P

    ```bash
    echo "INFO 12-02 14:07:00 [loader.py:88] Mapped 291 tensors from the weight cache daemon (zero_copy mode)"
    echo "2026-12-02 14:07:01,123 WARNING wcache.engine.core.engine: second line"
    echo done
    ```

    <!-- block: expect-output -->
    ```console
    Mapped ... tensors from the weight cache daemon (zero_copy mode)
    second line

    done
    ```
    """
    run(tmp_path, good)
    wrong_order = good.replace("    second line\n\n    done", "    done\n    second line")
    with pytest.raises(BlockFailure, match="expected line not found .*'second line'"):
        run(tmp_path, wrong_order)
    # A prefix is only tolerated when it looks like a log prefix, not arbitrary text.
    with pytest.raises(BlockFailure, match="expected line not found"):
        run(tmp_path, "# P\n\n```bash\necho 'not done'\n```\n\n<!-- block: expect-output -->\n```text\ndone\n```\n")


@pytest.mark.parametrize("expected, printed", [
    ("0", "10"),  # docs/parallelism.md shows `0` sockets left: 10 must not pass
    ("2 passed", "12 passed"),
    ("Mapped 27 tensors", "ERROR: Mapped 27 tensors"),
    ("Mapped 27 tensors", "ERROR 12-03 10:52:58 [wcache.daemon] Mapped 27 tensors"),
    ("Mapped 27 tensors", "xMapped 27 tensors"),
])
def test_a_log_prefix_is_whole_words_and_never_an_error_level(expected, printed) -> None:
    assert match_output(expected, [("out", printed)]) is not None
    # the same line with a real log prefix, or none, matches
    assert match_output(expected, [("out", expected)]) is None
    assert match_output(expected, [("out", f"INFO 12-03 10:52:58 [wcache.daemon] {expected}")]) is None


def test_an_indented_output_line_matches_its_stripped_expected_line() -> None:
    # `wcache bench --respawn` prints its phase line indented under the kill's line (benchmarks.md)
    printed = [("out", "  the median kill, phase by phase: death seen 1.0 ms = 2.0 ms")]
    assert match_output("  the median kill, phase by phase: death seen ... ms = ... ms", printed) is None
    assert match_output("the median kill, phase by phase: death seen ... ms", printed) is None


def test_an_error_line_shown_without_its_level_only_passes_after_an_expect_fail_block() -> None:
    printed = [("out", "ERROR 12-03 10:57:35 [wcache.cli] wcache serve runs one engine per rank")]
    assert match_output("wcache serve runs one engine per rank", printed) is not None
    assert match_output("wcache serve runs one engine per rank", printed, error_levels=True) is None
    assert match_output("ERROR ... wcache serve runs one engine per rank", printed) is None


LOADER_FAIL = """
# P

<!-- block: loader-config expect-fail -->
```json
BODY
```

<!-- block: expect-output -->
```text
Unknown ipc_cache loader key(s) ['fallbak']; valid keys: ...
```
"""


def test_an_expect_fail_json_block_checks_its_rejection_message(tmp_path: Path) -> None:
    run(tmp_path, LOADER_FAIL.replace("BODY", '{"fallbak": false}'))
    # Negative controls: another rejection, a parse error, and no message shown all fail the page.
    with pytest.raises(BlockFailure, match="(?s)expected line not found.*rejection of the json block"):
        run(tmp_path, LOADER_FAIL.replace("BODY", '{"mode": "nope"}'))
    with pytest.raises(BlockFailure, match="(?s)expected line not found.*rejection of the json block"):
        run(tmp_path, LOADER_FAIL.replace("BODY", '{"fallbak": fal'))
    with pytest.raises(BlockFailure, match="must be followed by an expect-output block"):
        run(tmp_path, LOADER_FAIL.split("<!-- block: expect-output -->")[0].replace("BODY", '{"fallbak": false}'))


def test_expect_output_needs_a_previous_bash_block(tmp_path: Path) -> None:
    with pytest.raises(BlockFailure, match="no bash block ran before it"):
        run(tmp_path, "# P\n\n<!-- block: expect-output -->\n```text\nx\n```\n")


def test_substitutions_are_applied_and_counted(tmp_path: Path) -> None:
    text = """
    # P

    ```bash
    CUDA_VISIBLE_DEVICES=0 echo wcache serve ./m --device cuda
    ```

    <!-- block: expect-output -->
    ```text
    wcache serve ./m --device cpu
    ```
    """
    recorder = Recorder()
    subs = load_substitutions()
    run(tmp_path, text, recorder=recorder, substitutions=subs)
    assert sum(recorder.substitutions_applied.values()) == 2
    assert "'--device cuda' -> '--device cpu' (applied 1x)" in format_summary([], recorder, subs)
    # A rewritten block is not counted as run as written: CI ran another command than the reader's.
    assert [r.kind for r in recorder.results] == [SUBSTITUTED, "validated"]
    blocks = extract_blocks(tmp_path / "page.md", tmp_path)
    assert "run 0 as written and 1 under a substitution" in format_summary(blocks, recorder, subs)
    assert disposition(blocks[0], gpu=True, subs=subs)[0] == "run"  # on a GPU host it runs as written
    assert disposition(blocks[0], gpu=False, subs=[])[0] == "run"


def test_the_vmm_fd_block_counts_as_a_substituted_run_on_a_cpu() -> None:
    """docs/gpu-transports.md's vmm_fd daemon and engine run the memfd transport on CI."""
    subs = load_substitutions()
    [block] = [b for b in extract_blocks(ROOT / "docs" / "gpu-transports.md")
               if b.lang == "bash" and "--weight-cache-transport vmm_fd" in b.source and not b.marker]
    assert disposition(block, gpu=False, subs=subs) == (SUBSTITUTED, "bash, '--device cuda' -> '--device cpu'")
    assert disposition(block, gpu=True, subs=subs) == ("run", "bash")


def test_background_jobs_are_stopped_at_the_end_of_the_page(tmp_path: Path) -> None:
    pids = tmp_path / "pids"
    text = f"""
    # P

    ```bash
    sleep 300 &
    echo "$!" >> {pids}
    bash -c 'sleep 301 & echo "$!" >> {pids}; wait' &
    echo "$!" >> {pids}
    ```

    ```bash
    for pid in $(cat {pids}); do kill -0 "$pid"; done
    ```
    """
    t0 = time.monotonic()
    run(tmp_path, text)
    assert time.monotonic() - t0 < 15
    started = [int(p) for p in pids.read_text().split()]
    assert len(started) == 3
    assert not [p for p in started if alive(p)]


def test_background_jobs_are_process_groups_as_in_a_terminal(tmp_path: Path) -> None:
    """Job control is on, as in the reader's terminal: `kill -- -$PID` stops a job and its children
    (a launcher and its ranks), with no rewriting of the command."""
    pids = tmp_path / "pids"
    text = f"""
    # P

    ```bash
    bash -c 'sleep 300 & echo "$!" > {pids}; wait' > job.log 2>&1 &
    JOB=$!
    until test -s {pids}; do sleep 0.1; done
    test "$(ps -o pgid= -p "$JOB" | tr -d ' ')" = "$JOB"
    ```

    ```bash
    kill -- -"$JOB"
    while kill -0 -- -"$JOB" 2>/dev/null; do sleep 0.1; done
    ! kill -0 "$(cat {pids})" 2>/dev/null
    ```
    """
    run(tmp_path, text)


def test_block_that_hangs_times_out(tmp_path: Path) -> None:
    t0 = time.monotonic()
    with pytest.raises(BlockFailure, match=r"(?s)timed out after 1s.*started"):
        run(tmp_path, '# P\n\n<!-- block: timeout="1" -->\n```bash\necho started\nsleep 60\necho never\n```\n')
    assert time.monotonic() - t0 < 10


def test_a_foreground_server_is_refused_as_it_would_hang_the_reader(tmp_path: Path) -> None:
    text = "# P\n\n```bash\necho start\nWCACHE_X=1 wcache serve ./m \\\n  --port 8123\n```\n"
    with pytest.raises(BlockFailure, match=r"'WCACHE_X=1 wcache serve ./m \\\\ --port 8123' runs in the foreground"):
        run(tmp_path, text)
    # A refused start returns at once, so an expect-fail block may show it in the foreground.
    run(tmp_path, "# P\n\n<!-- block: expect-fail -->\n```bash\nwcache serve --no-such-flag\n```\n")


def test_the_shell_reader() -> None:
    script = textwrap.dedent(
        """\
        VAR="a b" wcache serve ./m \\
          --port 8123 \\
          --model-loader-extra-config '{"mode":
            "copy"}'
        wcache preload --model ./m > preload.log 2>&1 &
        wcache serve --help
        cat <<EOF
        wcache serve inside a heredoc
        EOF
        python -m http.server 9 > 'http server.log' &  # a comment
        echo a && echo b > not-background.log
        """
    )
    assert [ll.text.split()[0] for ll in logical_lines(script)][:3] == ['VAR="a', "wcache", "wcache"]
    assert foreground_servers(script) == [
        """VAR="a b" wcache serve ./m \\ --port 8123 \\ --model-loader-extra-config '{"mode": "copy"}'"""]
    assert background_logs(script) == ["preload.log", "http server.log"]


# --- python ------------------------------------------------------------------------------------


def test_print_check_passes_and_shares_globals(tmp_path: Path) -> None:
    text = """
    # P

    ```python
    total = 1 + 1
    print(total)
    #> 2
    ```

    ```py
    print(total * 10)
    #> 20
    ```
    """
    run(tmp_path, text)


def test_print_check_mismatch_fails(tmp_path: Path) -> None:
    page = write_page(tmp_path, "# P\n\n```python\nprint(1 + 1)\n#> 3\n```\n")
    with pytest.raises(pytest.fail.Exception, match="Print output changed code"):
        run_page(page, root=tmp_path)


def test_python_examples_run_in_their_own_process(tmp_path: Path) -> None:
    """An example that changes its directory, environment, __main__ and modules changes nothing
    in the test process; one that raises fails its page with the exception."""
    text = """
    # P

    ```python
    import os
    import sys

    os.chdir("/")
    os.environ["DOCS_EXAMPLE_WAS_HERE"] = "1"
    sys.modules["docs_example_module"] = sys
    print(os.getpid() != int(os.environ["TEST_PID"]))
    #> True
    ```
    """
    before = (os.getcwd(), dict(os.environ), sys.modules["__main__"])
    run(tmp_path, text, extra_env={"TEST_PID": str(os.getpid())})
    assert (os.getcwd(), dict(os.environ), sys.modules["__main__"]) == before
    assert "docs_example_module" not in sys.modules
    page = write_page(tmp_path, '# P\n\n```python\nraise ValueError("boom")\n```\n', name="raises.md")
    with pytest.raises(pytest.fail.Exception, match="ValueError: boom"):
        run_page(page, root=tmp_path)
    assert (os.getcwd(), dict(os.environ), sys.modules["__main__"]) == before


# --- yaml / json -----------------------------------------------------------------------------

GOOD_COMPOSE = """\
services:
  weight-cache:
    image: wcache:0.1.0
    ipc: host
    healthcheck:
      test: ["CMD", "curl", "-sf", "http://127.0.0.1:8001/health"]
      start_period: 300s
  engine:
    image: wcache:0.1.0
    depends_on:
      weight-cache:
        condition: service_healthy
"""


def test_compose_files_are_validated(tmp_path: Path) -> None:
    (tmp_path / "examples").mkdir()
    (tmp_path / "examples" / "compose.yaml").write_text(GOOD_COMPOSE)
    text = """
    # P

    ```yaml
    --8<-- "examples/compose.yaml"
    ```
    """
    recorder = Recorder()
    run(tmp_path, text, recorder=recorder)
    assert recorder.results[0].detail == "compose (from examples/compose.yaml)"

    (tmp_path / "examples" / "compose.yaml").write_text(GOOD_COMPOSE.replace("ipc: host", "ipcc: host"))
    with pytest.raises(
        BlockFailure, match=r"(?s)compose.*from examples/compose.yaml.*'ipcc' was unexpected"
    ):
        run(tmp_path, text)

    inline_bad = "# P\n\n```yaml\nservices:\n  a:\n    image: x\n    depends_on: 3\n```\n"
    with pytest.raises(BlockFailure, match="compose: /services/a/depends_on"):
        run(tmp_path, inline_bad)


def test_missing_snippet_is_an_error(tmp_path: Path) -> None:
    page = write_page(tmp_path, '# P\n\n```yaml\n--8<-- "examples/nope.yaml"\n```\n')
    with pytest.raises(MarkerError, match="snippet 'examples/nope.yaml' not found"):
        extract_blocks(page, tmp_path)


def test_kubernetes_pod_specs_are_validated_strictly(tmp_path: Path) -> None:
    bare_spec = """
    # P

    ```yaml
    containers:
      - name: wcache
        image: wcache:0.1.0
        {extra}
    ```
    """
    run(tmp_path, bare_spec.format(extra="imagePullPolicy: IfNotPresent"))
    with pytest.raises(BlockFailure, match=r"strict\) Pod: /spec/containers/0: .*'imagePullPolicyy'"):
        run(tmp_path, bare_spec.format(extra="imagePullPolicyy: IfNotPresent"))
    full = """
    # P

    <!-- block: expect-fail -->
    ```yaml
    apiVersion: v1
    kind: Pod
    metadata:
      name: x
    spec:
      containers:
        - name: wcache
          image: wcache:0.1.0
          startupProbe:
            httpGet: {path: /health, port: 8001}
            failureThreshld: 60
    ```

    <!-- block: expect-output -->
    ```text
    kubernetes 1.30.0 (strict) Pod: /spec/containers/0/startupProbe: ... ('failureThreshld' was unexpected)
    ```
    """
    run(tmp_path, full)
    with pytest.raises(BlockFailure, match="failureThreshld"):
        run(tmp_path, full.replace("    <!-- block: expect-fail -->\n", ""))


def test_json_blocks(tmp_path: Path) -> None:
    run(tmp_path, '# P\n\n<!-- block: loader-config -->\n```json\n{"mode": "copy", "fallback": false}\n```\n')
    with pytest.raises(BlockFailure, match="JSON does not parse"):
        run(tmp_path, '# P\n\n```json\n{"mode": "copy",}\n```\n')


def test_loader_config_is_checked_by_wcache(tmp_path: Path) -> None:
    with pytest.raises(BlockFailure, match="LoaderConfigError"):
        run(tmp_path, '# P\n\n<!-- block: loader-config -->\n```json\n{"moed": "copy"}\n```\n')
    run(tmp_path, '# P\n\n<!-- block: loader-config expect-fail -->\n```json\n{"moed": "copy"}\n```\n\n'
                  '<!-- block: expect-output -->\n```text\nUnknown ipc_cache loader key(s) [\'moed\']; ...\n```\n')


# --- background preload / serve and `wcache wait` (stand-in servers, the real wait) -----------

FAKE_WCACHE = """\
#!{python}
# Stand-in for `wcache preload` / `wcache serve`, just enough for the real `wcache wait` to wait for.
import http.server, os, sys, time
kind, args = sys.argv[1], sys.argv[2:]
if kind == "wait":  # the real command
    os.execv(sys.executable, [sys.executable, "-m", "wcache.cli", *sys.argv[1:]])
with open(os.path.join(os.environ["FAKE_PID_DIR"], kind + ".pid"), "a") as f:
    f.write(f"{{os.getpid()}}\\n")
if "--fail" in args:
    print("engine failed: boom", flush=True)
    sys.exit(3)
while "--wait-for" in args and not os.path.exists(args[args.index("--wait-for") + 1]):
    time.sleep(0.05)
if kind == "preload":
    time.sleep(0.3)
    if "--never-ready" not in args:
        print("INFO 12-02 14:07:00 [launcher.py:1] Weight cache daemon READY", flush=True)
    time.sleep(3600)
port = int(args[args.index("--port") + 1]) if "--port" in args else 8000
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
        self.wfile.write(b"ok")
    def log_message(self, *a):
        pass
time.sleep(0.3)
print(f"serving on {{port}}", flush=True)
http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
"""


@pytest.fixture
def fake_wcache(tmp_path: Path) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    exe = bin_dir / "wcache"
    exe.write_text(FAKE_WCACHE.format(python=sys.executable))
    exe.chmod(0o755)
    return bin_dir


def run_fake(tmp_path: Path, fake_wcache: Path, text: str) -> PageRunner:
    return run(tmp_path, text, extra_path=[fake_wcache], extra_env={"FAKE_PID_DIR": str(tmp_path)})


def _pids(tmp_path: Path, kind: str) -> list[int]:
    f = tmp_path / f"{kind}.pid"
    return [int(p) for p in f.read_text().split()] if f.exists() else []


def test_preload_and_serve_in_the_background_are_waited_for_and_stopped(tmp_path: Path, fake_wcache) -> None:
    port = free_port()
    text = f"""
    # P

    ```bash
    export PORT={port}
    wcache preload --model ./m > preload.log 2>&1 &
    wcache wait --log preload.log
    MODE=zero_copy wcache serve ./m \\
      --port "$PORT" > engine.log 2>&1 &
    wcache wait --health "http://127.0.0.1:$PORT/health"
    ```

    ```bash
    curl -sf "http://127.0.0.1:$PORT/health"; echo
    ```

    <!-- block: expect-output -->
    ```text
    ok
    ```
    """
    run_fake(tmp_path, fake_wcache, text)
    started = _pids(tmp_path, "preload") + _pids(tmp_path, "serve")
    assert len(started) == 2
    assert not [p for p in started if alive(p)]


def test_stopping_an_engine_by_its_pid(tmp_path: Path, fake_wcache) -> None:
    """`$!` is the engine's own pid, as in an interactive shell: nothing wraps the command."""
    port = free_port()
    text = f"""
    # P

    ```bash
    wcache serve ./m --port {port} > engine.log 2>&1 &
    ENGINE_PID=$!
    wcache wait --health http://127.0.0.1:{port}/health --pid $ENGINE_PID
    ```

    ```bash
    kill "$ENGINE_PID"
    while kill -0 "$ENGINE_PID" 2>/dev/null; do sleep 0.1; done
    ```
    """
    run_fake(tmp_path, fake_wcache, text)
    assert len(_pids(tmp_path, "serve")) == 1


def test_expect_output_reads_the_logs_of_background_commands(tmp_path: Path, fake_wcache) -> None:
    text = """
    # P

    ```bash
    wcache preload --model ./m > preload.log 2>&1 &
    wcache wait --log preload.log
    ```

    <!-- block: expect-output -->
    ```log
    Weight cache daemon READY
    ```
    """
    run_fake(tmp_path, fake_wcache, text)


def test_serve_that_exits_early_fails_the_wait_with_its_log(tmp_path: Path, fake_wcache) -> None:
    port = free_port()
    text = f"""
    # P

    ```bash
    wcache serve ./m --port {port} --fail > engine.log 2>&1 &
    wcache wait --health http://127.0.0.1:{port}/health --pid $!
    echo not reached
    ```
    """
    with pytest.raises(BlockFailure, match=r"(?s)exited 2.*exited before it was ready.*engine failed: boom") as e:
        run_fake(tmp_path, fake_wcache, text)
    assert "not reached" not in str(e.value)


def test_preload_that_never_gets_ready_times_out_and_is_stopped(tmp_path: Path, fake_wcache) -> None:
    text = """
    # P

    ```bash
    wcache preload --model ./m --never-ready > preload.log 2>&1 &
    wcache wait --log preload.log --timeout 1
    ```
    """
    with pytest.raises(BlockFailure, match="Not ready after 1s"):
        run_fake(tmp_path, fake_wcache, text)
    assert _pids(tmp_path, "preload") and not [p for p in _pids(tmp_path, "preload") if alive(p)]


# --- command line and the real package ---------------------------------------------------------


def test_list_command(tmp_path: Path) -> None:
    page = write_page(
        tmp_path, '# P\n\n```bash\necho\n```\n\n<!-- block: skip reason="multi-node" -->\n```bash\nx\n```\n'
    )
    out = subprocess.run(
        [sys.executable, "-m", "tools.docs_runner", "list", str(page)],
        capture_output=True, text=True, check=True, cwd=ROOT,
    ).stdout
    assert "page.md:3" in out and "run" in out
    assert "page.md:8" in out and "skipped (multi-node)" in out
    assert "run 1 as written and 0 under a substitution, validated 0, skipped 1, unmarked 0" in out


def test_smoke_with_real_make_checkpoint(tmp_path: Path) -> None:
    if shutil.which("wcache", path=str(ROOT / ".venv" / "bin")) is None:
        pytest.skip("the wcache command is not installed in .venv (make dev installs it)")
    text = """
    # P

    ```bash
    wcache make-checkpoint ./tiny --preset tiny
    ls ./tiny
    ```

    <!-- block: expect-output -->
    ```text
    config.json
    ```
    """
    run(tmp_path, text)


def test_a_missing_validator_library_is_named_in_one_line(monkeypatch):
    """A GPU host's own Python may lack the dev extra; the page then fails saying which library."""
    from tools.docs_runner.handlers import validate

    monkeypatch.setitem(sys.modules, "kubernetes_validate", None)  # None in sys.modules: ImportError
    with pytest.raises(RuntimeError, match=r"^validating this block needs kubernetes-validate \(the dev extra"):
        validate.validate_yaml("apiVersion: v1\nkind: Pod\nmetadata: {name: x}\nspec: {containers: []}\n")


# --- what a page leaves behind ---------------------------------------------------------------


def test_a_page_that_cleans_up_after_itself_passes(tmp_path: Path) -> None:
    run(tmp_path, """
    # P

    ```bash
    WORK=$(mktemp -d)
    echo x > "$WORK/made" && echo y > here.log
    mkdir -p "$TMPDIR/wcache_$(id -u)" && touch "$TMPDIR/wcache_$(id -u)/wcache_weight_cache_cpu-0.sock.lock"
    ```

    ```bash
    rm -rf "$WORK" here.log
    ```
    """, check_leftovers=True)


@pytest.mark.parametrize("block, left", [
    ("echo y > engine.log && mkdir tiny && touch tiny/config.json",
     r"left in the working directory \(the reader's checkout\): engine\.log, tiny/config\.json"),
    ("mktemp -d > /dev/null", r"left in \$TMPDIR \(.*\): tmp\.\w+/ \(empty\)"),
    ("mkdir -p \"$TMPDIR/wcache_$(id -u)\" && touch \"$TMPDIR/wcache_$(id -u)/record.json\"",
     r"left in \$TMPDIR \(.*\): wcache_\d+/ \(record\.json\)"),
])
def test_a_page_that_leaves_files_fails_naming_them(tmp_path: Path, block: str, left: str) -> None:
    """The issue's leftovers: respawn.md's engine.log and tiny/ in the checkout, serve-reference.md's
    mktemp directory, anything but a daemon's lock file in wcache's socket directory."""
    with pytest.raises(BlockFailure, match=r"page\.md: " + left):
        run(tmp_path, f"""
        # P

        ```bash
        {block}
        ```
        """, check_leftovers=True)


@pytest.mark.parametrize("make", ["mkdir /tmp/{name}", "mktemp -d /tmp/{name}.XXXXXX"])
def test_a_page_that_leaves_a_path_it_names_in_tmp_fails(tmp_path: Path, make: str) -> None:
    """kubernetes.md's /tmp/tiny; serve-reference.md's and monitoring.md's mktemp -d /tmp/... directories."""
    name = f"wcache-leftover-test-{os.getpid()}"
    before = set(os.listdir("/tmp"))
    try:
        with pytest.raises(BlockFailure, match=f"left in /tmp: /tmp/{name}"):
            run(tmp_path, f"""
            # P

            ```bash
            {make.format(name=name)} > /dev/null
            ```
            """, check_leftovers=True)
    finally:
        for entry in set(os.listdir("/tmp")) - before:
            if entry.startswith(name):
                shutil.rmtree(f"/tmp/{entry}", ignore_errors=True)


def test_whole_output_fails_a_block_that_leaves_printed_lines_out(tmp_path: Path) -> None:
    """monitoring.md showed some of what its greps printed; whole-output makes the page show all of it."""
    page = """
    # P

    ```bash
    printf 'a 1\\nb 2\\nc 3\\n'
    ```

    <!-- block: expect-output whole-output -->
    ```text
    a ...
    {shown}
    ```
    """
    run(tmp_path, page.format(shown="b 2\n    c 3"))
    with pytest.raises(BlockFailure, match=r"marked whole-output, but the block printed 3 line\(s\) and the page "
                                           r"shows 2: a reader sees lines the page leaves out\nA 1\nb 2\nc 3"
                                           .replace("A 1", "a 1")):
        run(tmp_path, page.format(shown="c 3"))
