"""The autotune pass with real processes: the daemon tunes before binding its socket and a warm engine
runs no trial; an engine tunes itself when no cache exists; a failing pass is fatal to the daemon."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from procs import READY, complete
from wcache.daemon.launcher import STARTUP_FAILED

TUNED = re.compile(r"\[Autotuner\]: Tuned (\d+) configs in [\d.]+ s \((\d+) trials\); saved to (\S+\.json)")
LOADED = re.compile(r"\[Autotuner\]: Loaded (\d+) configs from (\S+\.json)")
TRIALS = re.compile(r"\[Autotuner\]: (\d+) tuning trials in this process")


# These tests are about where the cache lives and who tunes: each process uses its own cache root.
pytestmark = pytest.mark.usefixtures("own_autotune_cache")


def trials(log: str) -> list[int]:
    return [int(n) for n in TRIALS.findall(log)]


def test_daemon_tunes_before_its_socket_and_a_warm_engine_runs_no_trial(procs, tiny_model, wcache_env):
    daemon = procs.preload(tiny_model)
    log = daemon.log()
    tuned = TUNED.search(log)
    assert tuned, log
    n, n_trials, path = int(tuned[1]), int(tuned[2]), Path(tuned[3])
    assert n == 8 and n_trials == 8 * 5 and trials(log) == [n_trials]
    # Tuned and saved before the rank bound its socket and reported that it serves.
    assert log.index(tuned[0]) < log.index("Rank 0 serving on")
    assert path.parent == Path(wcache_env["WCACHE_CACHE_ROOT"]) / "autotune"
    doc = json.loads(path.read_text())
    assert len(doc["configs"]) == 8 and doc["created_by"] == "daemon rank 0" and doc["key"]["tp_rank"] == 0

    engine = procs.serve(tiny_model, "--load-format", "ipc_cache")
    elog = engine.log()
    loaded = LOADED.search(elog)
    assert loaded and int(loaded[1]) == 8 and Path(loaded[2]) == path, elog
    assert trials(elog) == [0] and "Tuned" not in elog
    assert complete(engine.port)["usage"]["completion_tokens"] == 8


def test_engine_tunes_itself_when_the_daemon_did_not_then_starts_warm(procs, tiny_model, wcache_env):
    daemon = procs.preload(tiny_model, "--no-enable-autotune")
    assert "[Autotuner]: skipped (--no-enable-autotune)" in daemon.log()
    assert not (Path(wcache_env["WCACHE_CACHE_ROOT"]) / "autotune").exists()
    cold = procs.serve(tiny_model, "--load-format", "ipc_cache")
    tuned = TUNED.search(cold.log())
    assert tuned and trials(cold.log()) == [40], cold.log()
    expected = complete(cold.port)["choices"][0]["token_ids"]
    cold.stop()
    warm = procs.serve(tiny_model, "--load-format", "ipc_cache")
    assert LOADED.search(warm.log())[2] == tuned[3] and trials(warm.log()) == [0]
    assert complete(warm.port)["choices"][0]["token_ids"] == expected


def test_a_failing_autotune_pass_is_fatal_to_the_daemon(procs, tiny_model, tmp_path):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    daemon = procs.preload(tiny_model, ready=False, env={"WCACHE_AUTOTUNE_CACHE_DIR": str(blocker / "autotune")})
    assert daemon.exit_code() != 0
    log = daemon.log()
    assert f"Autotune pass failed: cannot write {blocker / 'autotune'}" in log
    assert "Fix the cause or start with --no-enable-autotune" in log
    assert STARTUP_FAILED.split("(")[0] in log and READY not in log
