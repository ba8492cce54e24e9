"""`make demo` runs tools/demo.py: both load times, both answers, and that they agree."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_demo_prints_both_load_times_and_the_same_answer(wcache_env):
    p = subprocess.run([sys.executable, str(ROOT / "tools" / "demo.py")], check=False, env=wcache_env,
                       capture_output=True,
                       text=True, timeout=600, cwd=ROOT)
    out = p.stdout
    assert p.returncode == 0, out + p.stderr
    disk = re.search(r"^engine loaded weights in ([\d.]+) s from disk$", out, re.MULTILINE)
    cached = re.search(r"^engine restarted with --load-format ipc_cache: weights in ([\d.]+) s from "
                       r"the weight cache \(zero_copy\)$", out, re.MULTILINE)
    assert disk and cached, out
    answers = re.findall(r"^completion: 'The weight cache keeps' -> (.*)$", out, re.MULTILINE)
    assert len(answers) == 2 and answers[0] == answers[1], out
    assert "weight cache daemon READY" in out
    assert "same answer from both; daemon stopped cleanly" in out
