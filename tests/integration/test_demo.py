"""`make demo` runs tools/demo.py: a model trained on a README sentence completes it, the same words
from disk and from the cache; the small preset's load times and their ratio, and the same answer from
both engines; nothing left behind in the temporary directory, whether the demo ends or is stopped,
and nothing written to the home directory (every cache lives in the demo's own directory)."""

from __future__ import annotations

import ast
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))

import demo as demo_module  # noqa: E402
import sentence_model  # noqa: E402

# The environment variables through which wcache places a file outside the checkpoint and the
# sockets: a directory (..._DIR) or a root of directories (..._ROOT).
PLACES = re.compile(r"""environ\.get\(\s*["'](WCACHE_\w+_(?:DIR|ROOT))["']""")


def demo(env: dict, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(ROOT / "tools" / "demo.py")], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=ROOT, **kw)


def leftovers(env: dict) -> list[str]:
    return sorted(p.name for p in Path(env["TMPDIR"]).glob("wcache-demo-*"))


def test_the_demo_keeps_every_cache_the_package_places_in_its_own_directory(tmp_path):
    """Each WCACHE_*_DIR / _ROOT variable the package reads is set by the demo, under its directory:
    a new cache added to the package without the demo knowing fails here, not in a reader's ~/.cache."""
    read = {m.group(1) for path in (ROOT / "reference_impl" / "wcache").rglob("*.py")
            for m in PLACES.finditer(path.read_text(encoding="utf-8"))}
    assert {"WCACHE_CACHE_ROOT", "WCACHE_AUTOTUNE_CACHE_DIR", "WCACHE_STATE_DIR"} <= read, read
    env = demo_module.private_caches(tmp_path)
    assert read <= set(env), f"the demo leaves these to their defaults in the home directory: {read - set(env)}"
    assert all(Path(v).is_relative_to(tmp_path) for v in env.values()), env


def home_env(env: dict, home: Path) -> dict:
    """``env`` with an empty home of its own and none of the cache variables set: where the demo's
    processes would write by default, so that anything they leave there shows."""
    home.mkdir()
    out = {k: v for k, v in env.items() if not k.startswith(("WCACHE_", "XDG_"))}
    out["HOME"] = str(home)
    return out


def left_in(home: Path) -> list[str]:
    return sorted(str(p.relative_to(home)) for p in home.rglob("*") if p.is_file())


def test_the_demo_s_sentence_is_in_the_readme():
    readme = " ".join((ROOT / "README.md").read_text(encoding="utf-8").split())
    assert sentence_model.SENTENCE in readme
    assert sentence_model.SENTENCE.startswith(sentence_model.PROMPT)


@pytest.mark.slow
def test_demo_completes_the_sentence_and_prints_both_load_times_their_ratio_and_the_same_answer(wcache_env, tmp_path):
    env = home_env(wcache_env, tmp_path / "home")
    p = demo(env)
    out, err = p.communicate(timeout=600)
    assert p.returncode == 0, out + err
    # Words: the trained model completes the README's sentence, from disk and from the cache alike.
    said = re.findall(r"^    'The weight cache keeps' -> (.*)$", out, re.M)
    assert len(said) == 2 and said[0] == said[1], out
    assert ast.literal_eval(said[0]) == sentence_model.completion(), out
    assert "the sentence, the same from disk and from the cache: yes" in out
    # The ratio: the small preset from disk and from the cache.
    assert re.search(r"^the small preset: Llama layers with seeded random weights, 4\d\d MiB", out, re.M), out
    load = (r"weights ready in ([\d.]+) s \((\d+) tensors, ([\d.]+) MiB from {}\); start to /health 200: [\d.]+ s$")
    disk = re.findall("^  engine from disk: " + load.format("disk"), out, re.M)
    cached = re.findall(r"^  engine restarted with --load-format ipc_cache: "
                        + load.format(r"the weight cache \(zero_copy\)"), out, re.M)
    assert len(disk) == 2 and len(cached) == 2, out
    assert disk[1][1:] == cached[1][1:]  # the same weights, all of them
    ids = re.findall(r"^    token ids: (\[.*\])$", out, re.M)
    texts = re.findall(r"^    text:      (.*)$", out, re.M)
    assert len(ids) == 2 and ids[0] == ids[1] and len(ast.literal_eval(ids[0])) == 12, out
    assert len(texts) == 2 and texts[0] == texts[1] and texts[0] != "''", out
    assert len(re.findall(r"^  weight cache daemon ready: 1 rank\(s\) in [\d.]+ s$", out, re.M)) == 2, out
    assert "READY" not in out  # the daemon's log line is quoted, not doubled
    assert "same token ids from disk and from the cache: yes" in out
    ratio = re.search(r"^weights ready: ([\d.]+) s from disk, ([\d.]+) s from the cache: (\d+)x faster", out, re.M)
    assert ratio and float(ratio.group(1)) > 3 * float(ratio.group(2)), out  # mapping beats reading 470 MiB
    assert re.search(r"^start to /health 200: [\d.]+ s from disk, [\d.]+ s from the cache, -?[\d.]+ s of the "
                     r"difference being the weights; the rest of a start", out, re.M), out
    assert "costs both the same" not in out
    assert "both daemons stopped cleanly" in out
    assert leftovers(env) == [], "the demo left its checkpoints behind"
    assert left_in(tmp_path / "home") == [], "the demo wrote to the home directory (its caches belong in its own)"


@pytest.mark.slow  # about 40 s: it trains the sentence model and starts an engine before the Ctrl-C
def test_ctrl_c_stops_the_demo_and_removes_its_directory(wcache_env):
    """Ctrl-C reaches the demo's whole process group (the demo, its engine, its daemon): the
    temporary directory goes with it, and no wcache process outlives the demo."""
    p = demo(wcache_env, start_new_session=True)
    deadline = time.monotonic() + 300
    while not any(Path(wcache_env["TMPDIR"]).glob("wcache-demo-*/sentence*-engine-disk.log")):
        assert p.poll() is None and time.monotonic() < deadline, p.communicate()
        time.sleep(0.2)
    os.killpg(p.pid, signal.SIGINT)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 130, out + err
    assert "demo: interrupted" in err
    assert leftovers(wcache_env) == [], "the demo left its directory behind"
    alive = running_in_group(p.pid)
    assert alive == [], f"processes of the demo's group still running: {alive}"


def running_in_group(pgid: int) -> list[str]:
    """pid and command of every process of the group that is not a zombie (an exited process whose
    parent has gone: in a container without an init, nobody reaps it, but it holds nothing)."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue  # it exited while we looked
        fields = text[text.rindex(")") + 2:].split()  # after "pid (comm) ": state, ppid, pgrp, ...
        if int(fields[2]) == pgid and fields[0] != "Z":
            out.append(f"{stat.parent.name} {text[text.index('(') + 1:text.rindex(')')]}")
    return out
