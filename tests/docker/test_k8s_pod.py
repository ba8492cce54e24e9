"""examples/k8s-pod.yaml: strictly valid Kubernetes, and its container script under the probes.

The probe harness (tools/k8s_probe.py) runs the container's command as a real process tree in a
private network namespace and applies the spec's startup, liveness and readiness probes with
their own periods and thresholds. Killing the engine's serving worker must have `wcache serve
--respawn` promote its spare, which maps the weights again, while the daemon and the engine's
supervisor keep their PIDs, no probe fails and the container is never restarted; killing the
daemon must fail the liveness probe and restart the whole container.
"""

from __future__ import annotations

import copy
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import yaml
from dockerlib import ROOT, mapped_line
from tools.docs_runner.handlers.validate import validate_k8s

POD = ROOT / "examples" / "k8s-pod.yaml"
HARNESS = ROOT / "tools" / "k8s_probe.py"


def pod() -> dict:
    return yaml.safe_load(POD.read_text())


def script(doc: dict) -> str:
    c = doc["spec"]["containers"][0]
    return " ".join(c["command"][:2] + c["args"])


def test_pod_spec_is_strictly_valid():
    doc = pod()
    assert validate_k8s(doc) == []
    # Strict means strict: a misspelt field is an error, not silently ignored.
    bad = copy.deepcopy(doc)
    bad["spec"]["containers"][0]["livenessProbes"] = bad["spec"]["containers"][0].pop("livenessProbe")
    assert any("livenessProbes" in e for e in validate_k8s(bad))


def test_probes_check_the_ports_the_processes_listen_on():
    doc = pod()
    c = doc["spec"]["containers"][0]
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    s = script(doc)
    health = int(re.search(r"--weight-cache-health-port (\d+)", s).group(1))
    engine = int(re.search(r"wcache serve .*?--port (\d+)", s, re.S).group(1))
    assert re.search(r"wcache serve [^\n]*--respawn", s)  # the engine's socket outlives its workers
    for probe in ("startupProbe", "livenessProbe"):
        assert ports[c[probe]["httpGet"]["port"]] == health, probe
    assert ports[c["readinessProbe"]["httpGet"]["port"]] == engine
    assert '"fallback": false' in s  # a cold engine waits for the daemon instead of loading from disk
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1


def _run_harness(model: Path, tmp: Path, steps: list[str], timeout: float = 300) -> tuple[list[dict], str]:
    if os.geteuid() != 0:
        pytest.skip("probe harness: needs root for a private network namespace (the spec's ports, no collisions)")
    short = Path(tempfile.mkdtemp(prefix="wck-", dir="/tmp"))  # a Unix socket path must stay short
    report, log = tmp / "probes.jsonl", tmp / "container.log"
    env_args = [f"MODEL_DIR={model}", f"TMPDIR={short}", f"WCACHE_CACHE_ROOT={tmp / 'cache'}",
                "VLLM_API_KEY=the-secret-s-key",  # what the kubelet puts there from the Secret wcache-api-key
                f"PATH={Path(sys.executable).parent}:{os.environ.get('PATH', '/usr/bin:/bin')}"]
    argv = [sys.executable, str(HARNESS), str(POD), "--report", str(report), "--log", str(log)]
    argv += [a for e in env_args for a in ("--env", e)] + [a for s in steps for a in ("--step", s)]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    out = log.read_text(errors="replace") if log.exists() else ""
    assert r.returncode == 0, f"harness failed:\n{r.stdout}\n{r.stderr}\ncontainer log:\n{out[-6000:]}"
    return [json.loads(line) for line in report.read_text().splitlines()], out


def _one(processes: dict, pattern: str) -> int:
    found = [int(pid) for pid, cmd in processes.items() if re.search(pattern, cmd)]
    assert len(found) == 1, (pattern, processes)
    return found[0]


#: The steps of a respawn: the pod is Ready and the spare has imported, the serving worker (the
#: older of the two) is killed, the supervisor logs the respawn, and the pod is Ready.
RESPAWN_STEPS = ["ready", "log=1:Spare engine worker pid", r"kill-oldest=-m wcache\.engine\.respawn\.spare",
                 "log=1:Respawned: engine worker pid", "ready"]


def check_respawn(events: list[dict], log: str) -> None:
    """The serving worker was replaced by the spare on the same socket, inside one container run:
    the daemon and the engine's supervisor kept their PIDs, no probe failed, and the new worker
    mapped the daemon's weights."""
    steps = [e for e in events if e["event"] == "step_done"]
    first, _, killed, _, second, stop = steps
    launcher, rank = _one(first["processes"], r"bin/wcache preload"), _one(first["processes"], r"-m wcache\.daemon")
    supervisor = _one(first["processes"], r"bin/wcache serve")
    (victim,) = [int(p) for p in killed["killed"]]
    assert f"Engine ready (pid {victim})" in log
    assert f"Engine worker pid {victim} died (signal SIGKILL); promoting spare pid" in log
    assert _one(second["processes"], r"bin/wcache preload") == launcher
    assert _one(second["processes"], r"-m wcache\.daemon") == rank
    assert _one(second["processes"], r"bin/wcache serve") == supervisor  # the socket's owner never died
    assert str(victim) not in second["processes"]
    # One container run, and neither probe failed: liveness watches the daemon, and readiness
    # requests waited in the socket's backlog for the spare instead of being refused.
    # (Readiness failed only before the first worker was ready, with its 503 while loading.)
    assert [e["event"] for e in events].count("container_started") == 1
    assert not [e for e in events if e["event"] in ("restart_scheduled", "not_ready")]
    assert all(e["ok"] for e in events if e["event"] == "probe" and e["probe"] == "liveness")
    after = [e for e in events if e["event"] == "probe" and e["probe"] == "readiness" and e["t"] >= killed["t"]]
    assert after and all(e["ok"] for e in after), after
    # Both workers mapped the daemon's weights; none loaded its own copy from disk.
    assert log.count(mapped_line()) in (2, 3), log  # and the next hot spare, if it mapped before the stop
    assert "falling back" not in log
    # Pod deletion: SIGTERM to the script stops the daemon, the supervisor and its workers.
    assert stop["exit_code"] == 0


@pytest.mark.slow
def test_killed_engine_worker_is_respawned_in_place_without_a_failed_probe(tiny_model, tmp_path):
    events, log = _run_harness(tiny_model, tmp_path, RESPAWN_STEPS)
    check_respawn(events, log)


@pytest.mark.slow
def test_dead_daemon_fails_liveness_and_the_container_restarts(tiny_model, tmp_path):
    events, log = _run_harness(tiny_model, tmp_path, ["ready", "kill=bin/wcache preload", "restarted", "ready"])
    restarts = [e for e in events if e["event"] == "restart_scheduled"]
    assert len(restarts) == 1 and restarts[0]["reason"].startswith("liveness probe failed 3 times"), restarts
    liveness = [e for e in events if e["event"] == "probe" and e["probe"] == "liveness"]
    assert [e["ok"] for e in liveness].count(False) == 3
    assert [e["event"] for e in events].count("container_started") == 2
    assert log.count("Weight cache daemon READY") == 2
    assert log.count(mapped_line()) >= 2
