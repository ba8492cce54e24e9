"""`wcache bench --seed --seed-replicas N` takes 0 (no fan-out round: one GPU holds a source and one
replica of a large model) to the largest round a source serves, and refuses anything else before it
starts a daemon, in one line."""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.parametrize("replicas", ["-1", "16"])
def test_a_round_size_out_of_range_is_one_line_and_exit_2(tiny_model, replicas):
    out = subprocess.run([sys.executable, "-m", "wcache.cli", "bench", "--seed", "--seed-replicas", replicas,
                          "--model", str(tiny_model), "--device", "cpu"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr
    assert f"--seed-replicas must be from 0 to 15 (0: no fan-out round), got {replicas}" in out.stderr
    assert "Traceback" not in out.stderr and "daemon" not in out.stderr  # refused before any daemon started
