"""Tests of the block runner itself (tools/blocks.py), on tiny markdown pages written to tmp_path.

Everything here is real: bash runs, processes start and are killed, schemas validate. A stand-in
`wcache` script (a few lines of Python) exercises the preload/serve readiness waits without
depending on the real package; one smoke test uses the real `wcache` when it is installed.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import blocks
import pytest

ROOT = blocks.ROOT


def write_page(tmp_path: Path, text: str, name: str = "page.md") -> Path:
    page = tmp_path / name
    page.write_text(textwrap.dedent(text).lstrip(), encoding="utf-8")
    return page


def run(tmp_path: Path, request: pytest.FixtureRequest, text: str, **kwargs) -> blocks.PageRunner:
    """Run a page through PageRunner (BlockFailure propagates); fast teardown grace."""
    runner = blocks.PageRunner(
        write_page(tmp_path, text), request=request, root=tmp_path, grace=3.0, **kwargs
    )
    runner.run()
    return runner


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def alive(pid: int) -> bool:
    st = blocks._proc_stat(pid)
    return st is not None and st[0] not in ("Z", "X")


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
        """,
    )
    found = blocks.extract_blocks(page, tmp_path)
    assert [(b.line, b.lang) for b in found] == [(4, "bash"), (11, "text"), (17, "python"), (21, "markdown")]
    assert found[0].marker.reason == "GPU-only: needs a CUDA device"
    assert found[1].marker.has("expect-output") and found[1].body == "hello\n"
    assert found[2].body == "print(1)\n"
    assert "not a block of its own" in found[3].body
    assert blocks.disposition(found[0], gpu=False) == ("skipped", "GPU-only: needs a CUDA device")
    assert blocks.disposition(found[0], gpu=True) == ("run", "bash")
    assert blocks.disposition(found[3])[0] == "unmarked"


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
    with pytest.raises(blocks.MarkerError, match=message):
        blocks.extract_blocks(page, tmp_path)


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
    assert len(blocks.extract_blocks(ok, tmp_path)) == 1
    bad = write_page(tmp_path, "# P\n\nParagraph.\n\n    indented code\n", name="bad.md")
    with pytest.raises(blocks.MarkerError, match="bad.md:5: indented code block"):
        blocks.extract_blocks(bad, tmp_path)


def test_orphan_marker_is_rejected(tmp_path: Path) -> None:
    page = write_page(tmp_path, '# P\n\n<!-- block: skip reason="x" -->\n\nSome text.\n')
    with pytest.raises(blocks.MarkerError, match="not followed by a fenced block"):
        blocks.extract_blocks(page, tmp_path)


def test_skip_without_reason_fails_the_page_test(tmp_path: Path, request) -> None:
    page = write_page(tmp_path, "# P\n\n<!-- block: skip -->\n```bash\necho hi\n```\n")
    with pytest.raises(pytest.fail.Exception, match="needs a non-empty reason"):
        blocks.run_page(page, request=request, root=tmp_path)


def test_unmarked_console_block_is_counted_unmarked(tmp_path: Path, request) -> None:
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
    recorder = blocks.Recorder()
    run(tmp_path, request, text, recorder=recorder)
    assert [r.kind for r in recorder.results] == ["run", "unmarked", "skipped"]
    cov = blocks.coverage(blocks.extract_blocks(tmp_path / "page.md", tmp_path))
    assert cov["unmarked"] == ["page.md:7 (console block without a marker)"]
    assert cov["skipped_reasons"] == {"illustration: what a log looks like": 1}
    assert "unmarked 1" in blocks.format_summary(blocks.extract_blocks(tmp_path / "page.md", tmp_path))


# --- bash --------------------------------------------------------------------------------------


def test_bash_blocks_share_state_in_order(tmp_path: Path, request) -> None:
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

    print(os.path.basename(os.getcwd()), tempfile.gettempdir() == os.environ["TMPDIR"])
    #> sub True
    ```
    """
    run(tmp_path, request, text)


def test_gpu_only_blocks_run_in_gpu_mode(tmp_path: Path, request) -> None:
    text = f"""
    # P

    <!-- block: skip reason="GPU-only: needs a CUDA device" -->
    ```bash
    echo wcache serve ./m --device cuda > {tmp_path}/ran
    ```
    """
    run(tmp_path, request, text, gpu=False)
    assert not (tmp_path / "ran").exists()
    run(tmp_path, request, text, gpu=True)
    assert (tmp_path / "ran").read_text() == "wcache serve ./m --device cuda\n"  # no substitution


def test_failing_bash_block_fails(tmp_path: Path, request) -> None:
    text = """
    # P

    ```bash
    echo before
    false
    echo after
    ```
    """
    with pytest.raises(blocks.BlockFailure, match=r"page.md:3 \(bash block\): exited 1") as e:
        run(tmp_path, request, text)
    assert "before" in str(e.value) and "after" not in str(e.value)


def test_pipefail_and_expect_fail(tmp_path: Path, request) -> None:
    with pytest.raises(blocks.BlockFailure, match="exited 1"):
        run(tmp_path, request, "# P\n\n```bash\nfalse | true\n```\n")
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
    run(tmp_path, request, text)
    with pytest.raises(blocks.BlockFailure, match="marked expect-fail but exited 0"):
        run(tmp_path, request, "# P\n\n<!-- block: expect-fail -->\n```bash\ntrue\n```\n")


def test_failure_through_pytest_is_a_plain_fail(tmp_path: Path, request) -> None:
    page = write_page(tmp_path, "# P\n\n```bash\nexit 7\n```\n")
    with pytest.raises(pytest.fail.Exception, match="exited 7"):
        blocks.run_page(page, request=request, root=tmp_path)


def test_expect_output_in_order_with_log_prefixes(tmp_path: Path, request) -> None:
    good = """
    # P

    ```bash
    echo "INFO 12-02 14:07:00 [loader.py:88] Mapped 291 tensors from the weight cache daemon (zero_copy mode)"
    echo "2026-12-02 14:07:01,123 WARNING wcache.engine.engine: second line"
    echo done
    ```

    <!-- block: expect-output -->
    ```console
    Mapped ... tensors from the weight cache daemon (zero_copy mode)
    second line

    done
    ```
    """
    run(tmp_path, request, good)
    wrong_order = good.replace("    second line\n\n    done", "    done\n    second line")
    with pytest.raises(blocks.BlockFailure, match="expected line not found .*'second line'"):
        run(tmp_path, request, wrong_order)
    # A prefix is only tolerated when it looks like a log prefix, not arbitrary text.
    with pytest.raises(blocks.BlockFailure, match="expected line not found"):
        run(
            tmp_path,
            request,
            "# P\n\n```bash\necho 'not done'\n```\n\n<!-- block: expect-output -->\n```text\ndone\n```\n",
        )


def test_expect_output_needs_a_previous_bash_block(tmp_path: Path, request) -> None:
    with pytest.raises(blocks.BlockFailure, match="no bash block ran before it"):
        run(tmp_path, request, "# P\n\n<!-- block: expect-output -->\n```text\nx\n```\n")


def test_substitutions_are_applied(tmp_path: Path, request) -> None:
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
    recorder = blocks.Recorder()
    run(tmp_path, request, text, recorder=recorder, substitutions=blocks.load_substitutions())
    assert sum(recorder.substitutions_applied.values()) == 2


def test_background_process_is_killed_at_teardown(tmp_path: Path, request) -> None:
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
    run(tmp_path, request, text)
    assert time.monotonic() - t0 < 15
    started = [int(p) for p in pids.read_text().split()]
    assert len(started) == 3
    assert not [p for p in started if alive(p)]


def test_block_that_hangs_times_out(tmp_path: Path, request, monkeypatch) -> None:
    monkeypatch.setattr(blocks, "BLOCK_TIMEOUT_S", 1.0)
    t0 = time.monotonic()
    with pytest.raises(blocks.BlockFailure, match=r"(?s)timed out after 1s.*started"):
        run(tmp_path, request, "# P\n\n```bash\necho started\nsleep 60\necho never\n```\n")
    assert time.monotonic() - t0 < 10


def test_rewrite_script_finds_long_running_commands() -> None:
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
        python -m http.server 9 &  # a comment
        echo a && echo b
        """
    )
    out, started = blocks.rewrite_script(script, Path("/tmp/logs"), "t", 5)
    assert [s.kind for s in started] == ["serve", "preload", "bg"]
    assert "--port 8123" in out and "__wcb_await --kind serve" in out
    assert "--log preload.log" in out
    assert "wcache serve --help\n" in out
    assert "cat <<EOF\nwcache serve inside a heredoc\nEOF\n" in out
    assert "setsid bash -o pipefail -c 'exec python -m http.server 9'" in out
    assert "echo a && echo b" in out
    subprocess.run(["bash", "-n"], input=out, text=True, check=True)


# --- python ------------------------------------------------------------------------------------


def test_print_check_passes_and_shares_globals(tmp_path: Path, request) -> None:
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
    run(tmp_path, request, text)


def test_print_check_mismatch_fails(tmp_path: Path, request) -> None:
    page = write_page(tmp_path, "# P\n\n```python\nprint(1 + 1)\n#> 3\n```\n")
    with pytest.raises(pytest.fail.Exception, match="Print output changed code"):
        blocks.run_page(page, request=request, root=tmp_path)


def test_python_example_that_raises_fails_cleanly(tmp_path: Path, request) -> None:
    page = write_page(tmp_path, '# P\n\n```python\nraise ValueError("boom")\n```\n')
    main = sys.modules["__main__"]
    with pytest.raises(pytest.fail.Exception, match="ValueError: boom"):
        blocks.run_page(page, request=request, root=tmp_path)
    assert sys.modules["__main__"] is main


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


def test_compose_files_are_validated(tmp_path: Path, request) -> None:
    (tmp_path / "examples").mkdir()
    (tmp_path / "examples" / "compose.yaml").write_text(GOOD_COMPOSE)
    text = """
    # P

    ```yaml
    --8<-- "examples/compose.yaml"
    ```
    """
    recorder = blocks.Recorder()
    run(tmp_path, request, text, recorder=recorder)
    assert recorder.results[0].detail == "compose (from examples/compose.yaml)"

    (tmp_path / "examples" / "compose.yaml").write_text(GOOD_COMPOSE.replace("ipc: host", "ipcc: host"))
    with pytest.raises(
        blocks.BlockFailure, match=r"(?s)compose.*from examples/compose.yaml.*'ipcc' was unexpected"
    ):
        run(tmp_path, request, text)

    inline_bad = "# P\n\n```yaml\nservices:\n  a:\n    image: x\n    depends_on: 3\n```\n"
    with pytest.raises(blocks.BlockFailure, match="compose: /services/a/depends_on"):
        run(tmp_path, request, inline_bad)


def test_missing_snippet_is_an_error(tmp_path: Path) -> None:
    page = write_page(tmp_path, '# P\n\n```yaml\n--8<-- "examples/nope.yaml"\n```\n')
    with pytest.raises(blocks.MarkerError, match="snippet 'examples/nope.yaml' not found"):
        blocks.extract_blocks(page, tmp_path)


def test_kubernetes_pod_specs_are_validated_strictly(tmp_path: Path, request) -> None:
    bare_spec = """
    # P

    ```yaml
    containers:
      - name: wcache
        image: wcache:0.1.0
        {extra}
    ```
    """
    run(tmp_path, request, bare_spec.format(extra="imagePullPolicy: IfNotPresent"))
    with pytest.raises(blocks.BlockFailure, match=r"strict\) Pod: /spec/containers/0: .*'imagePullPolicyy'"):
        run(tmp_path, request, bare_spec.format(extra="imagePullPolicyy: IfNotPresent"))
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
    """
    run(tmp_path, request, full)
    with pytest.raises(blocks.BlockFailure, match="failureThreshld"):
        run(tmp_path, request, full.replace("    <!-- block: expect-fail -->\n", ""))


def test_json_blocks(tmp_path: Path, request) -> None:
    run(
        tmp_path,
        request,
        '# P\n\n<!-- block: loader-config -->\n```json\n{"mode": "copy", "fallback": false}\n```\n',
    )
    with pytest.raises(blocks.BlockFailure, match="JSON does not parse"):
        run(tmp_path, request, '# P\n\n```json\n{"mode": "copy",}\n```\n')


def test_loader_config_is_checked_by_wcache(tmp_path: Path, request) -> None:
    loader = pytest.importorskip("wcache.engine.loader", reason="wcache.engine.loader not importable yet")
    if not hasattr(loader, "parse_loader_config"):
        pytest.skip("wcache.engine.loader.parse_loader_config not written yet")
    with pytest.raises(blocks.BlockFailure, match="LoaderConfigError"):
        run(tmp_path, request, '# P\n\n<!-- block: loader-config -->\n```json\n{"moed": "copy"}\n```\n')
    run(
        tmp_path,
        request,
        '# P\n\n<!-- block: loader-config expect-fail -->\n```json\n{"moed": "copy"}\n```\n',
    )


# --- awaited wcache preload / serve (stand-in executable) ------------------------------------

FAKE_WCACHE = """\
#!{python}
# Stand-in for the wcache CLI: just enough to exercise the runner's readiness waits.
import http.server, os, sys, time
kind, args = sys.argv[1], sys.argv[2:]
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
def fake_wcache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    exe = bin_dir / "wcache"
    exe.write_text(FAKE_WCACHE.format(python=sys.executable))
    exe.chmod(0o755)
    monkeypatch.setenv("FAKE_PID_DIR", str(tmp_path))
    return bin_dir


def _pids(tmp_path: Path, kind: str) -> list[int]:
    f = tmp_path / f"{kind}.pid"
    return [int(p) for p in f.read_text().split()] if f.exists() else []


def test_preload_and_serve_are_awaited_and_stopped(tmp_path: Path, request, fake_wcache) -> None:
    port = free_port()
    text = f"""
    # P

    ```bash
    export PORT={port}
    wcache preload --model ./m
    MODE=zero_copy wcache serve ./m \\
      --port "$PORT"
    ```

    ```bash
    curl -sf "http://127.0.0.1:$PORT/health"; echo
    ```

    <!-- block: expect-output -->
    ```text
    ok
    ```
    """
    run(tmp_path, request, text, extra_path=[fake_wcache])
    started = _pids(tmp_path, "preload") + _pids(tmp_path, "serve")
    assert len(started) == 2
    assert not [p for p in started if alive(p)]


def test_stopping_an_engine_by_its_pid(tmp_path: Path, request, fake_wcache) -> None:
    port = free_port()
    text = f"""
    # P

    ```bash
    wcache serve ./m --port {port} &
    ENGINE_PID=$!
    ```

    ```bash
    kill "$ENGINE_PID"
    while curl -s "http://127.0.0.1:{port}/health" >/dev/null; do sleep 0.1; done
    ```
    """
    run(tmp_path, request, text, extra_path=[fake_wcache])
    assert len(_pids(tmp_path, "serve")) == 1


def test_a_wcache_line_ending_with_ampersand_is_awaited_at_the_end_of_its_block(
    tmp_path: Path, request, fake_wcache
) -> None:
    """`&` returns at once in a shell: the engine below gets ready only after the next line ran."""
    port = free_port()
    text = f"""
    # P

    ```bash
    wcache serve ./m --port {port} --wait-for go > engine.log 2>&1 &
    touch go
    ```

    ```bash
    curl -sf "http://127.0.0.1:{port}/health"; echo
    ```

    <!-- block: expect-output -->
    ```text
    ok
    ```
    """
    run(tmp_path, request, text, extra_path=[fake_wcache], ready_timeout=10)


def test_a_redirected_background_command_is_its_own_pid(tmp_path: Path, request) -> None:
    """`cmd > log 2>&1 &` then `kill $!` must stop cmd, as in an interactive shell: the runner's
    `bash -c` wrapper execs a simple command instead of waiting for it as a child."""
    text = """
    # P

    ```bash
    sleep 30 > sleep.log 2>&1 &
    SLEEPER=$!
    ```

    ```bash
    test "$(cat /proc/$SLEEPER/comm)" = sleep
    kill $SLEEPER
    while kill -0 $SLEEPER 2>/dev/null; do sleep 0.1; done
    ```
    """
    run(tmp_path, request, text)
    for a, b in [("wcache serve m > e.log 2>&1", "exec wcache serve m > e.log 2>&1"),
                 ("A=1 wcache serve m", "A=1 exec wcache serve m"),
                 ("wcache serve m | tee e.log", None), ("a && b", None), ("cd d; wcache serve m", None)]:
        assert blocks.exec_form(a) == (b or a)


def test_expect_output_sees_background_logs(tmp_path: Path, request, fake_wcache) -> None:
    text = """
    # P

    ```bash
    wcache preload --model ./m
    ```

    <!-- block: expect-output -->
    ```log
    Weight cache daemon READY
    ```
    """
    run(tmp_path, request, text, extra_path=[fake_wcache])


def test_serve_that_exits_early_fails_with_its_log(tmp_path: Path, request, fake_wcache) -> None:
    text = f"# P\n\n```bash\nwcache serve ./m --port {free_port()} --fail\necho not reached\n```\n"
    with pytest.raises(
        blocks.BlockFailure, match=r"(?s)exited before it was ready.*engine failed: boom"
    ) as e:
        run(tmp_path, request, text, extra_path=[fake_wcache])
    assert "not reached" not in str(e.value)


def test_preload_that_never_gets_ready_times_out(tmp_path: Path, request, fake_wcache) -> None:
    text = '# P\n\n<!-- block: timeout="1" -->\n```bash\nwcache preload --model ./m --never-ready\n```\n'
    with pytest.raises(blocks.BlockFailure, match="not ready after 1s"):
        run(tmp_path, request, text, extra_path=[fake_wcache])
    assert not [p for p in _pids(tmp_path, "preload") if alive(p)]


# --- command line and the real package ---------------------------------------------------------


def test_list_command(tmp_path: Path) -> None:
    page = write_page(
        tmp_path, '# P\n\n```bash\necho\n```\n\n<!-- block: skip reason="multi-node" -->\n```bash\nx\n```\n'
    )
    out = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "blocks.py"), "list", str(page)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "page.md:3" in out and "run" in out
    assert "page.md:8" in out and "skipped (multi-node)" in out
    assert "run 1, validated 0, skipped 1, unmarked 0" in out


def _real_wcache() -> str | None:
    import importlib.util

    exe = shutil.which("wcache", path=str(ROOT / ".venv" / "bin"))
    try:
        has_checkpoint = importlib.util.find_spec("wcache.core.checkpoint") is not None
    except ImportError:
        has_checkpoint = False
    return exe if exe and has_checkpoint else None


def test_smoke_with_real_make_checkpoint(tmp_path: Path, request) -> None:
    if _real_wcache() is None:
        pytest.skip("the wcache package (make-checkpoint) is not installed in .venv yet")
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
    run(tmp_path, request, text)
