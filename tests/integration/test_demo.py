"""`make demo` runs tools/demo.py: both load times and their ratio on the small preset, and the same
answer from both engines, as token ids and as text without replacement characters."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_demo_prints_both_load_times_their_ratio_and_the_same_answer(wcache_env):
    p = subprocess.run([sys.executable, str(ROOT / "tools" / "demo.py")], check=False, env=wcache_env,
                       capture_output=True, text=True, timeout=600, cwd=ROOT)
    out = p.stdout
    assert p.returncode == 0, out + p.stderr
    assert re.search(r"^made the small preset \(Llama layers with seeded random weights, 4\d\d MiB\)", out, re.M), out
    disk = re.search(r"^engine from disk: weights ready in ([\d.]+) s \((\d+) tensors, ([\d.]+) MiB from disk\)$",
                     out, re.M)
    cached = re.search(r"^engine restarted with --load-format ipc_cache: weights ready in ([\d.]+) s \((\d+) tensors, "
                       r"([\d.]+) MiB from the weight cache \(zero_copy\)\)$", out, re.M)
    assert disk and cached, out
    assert disk.group(2, 3) == cached.group(2, 3)  # the same weights, all of them
    ids = re.findall(r"^    token ids: (\[.*\])$", out, re.M)
    texts = re.findall(r"^    text:      (.*)$", out, re.M)
    assert len(ids) == 2 and ids[0] == ids[1] and len(ast.literal_eval(ids[0])) == 12, out
    assert len(texts) == 2 and texts[0] == texts[1] and texts[0] != "''", out
    assert "\ufffd" not in out and "\\ufffd" not in out  # no replacement characters
    assert "weight cache daemon: Weight cache daemon READY" in out
    assert "same token ids from disk and from the cache: yes" in out
    ratio = re.search(r"^weights ready: ([\d.]+) s from disk, ([\d.]+) s from the cache: (\d+)x faster$", out, re.M)
    assert ratio and float(ratio.group(1)) > 3 * float(ratio.group(2)), out  # mapping beats reading 470 MiB
    assert "daemon stopped cleanly" in out
