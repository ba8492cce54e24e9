"""examples/k8s-deployment.yaml: strictly valid Kubernetes, the one-container pod's container with the
additions docs/kubernetes.md lists, and its script under its own probes.

The container's script is the pod's (examples/k8s-pod.yaml) plus the seeding flags and the loader's
``state_timeout_s``; the probe harness (tools/k8s_probe.py) runs it from a Pod made of the
Deployment's template, as the kubelet would run each replica.
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
from dockerlib import ROOT
from test_k8s_pod import RESPAWN_STEPS, check_respawn
from tools.docs_runner.handlers.validate import validate_k8s

DEPLOYMENT = ROOT / "examples" / "k8s-deployment.yaml"
POD = ROOT / "examples" / "k8s-pod.yaml"
HARNESS = ROOT / "tools" / "k8s_probe.py"


def docs() -> dict[str, dict]:
    """kind -> object (the two Services by name)."""
    out = {}
    for d in yaml.safe_load_all(DEPLOYMENT.read_text()):
        out[d["kind"] if d["kind"] != "Service" else f"Service/{d['metadata']['name']}"] = d
    return out


def container() -> dict:
    return docs()["Deployment"]["spec"]["template"]["spec"]["containers"][0]


def script(c: dict) -> str:
    return " ".join(c["command"][:2] + c["args"])


def test_every_object_is_strictly_valid():
    pytest.importorskip("kubernetes_validate", reason="kubernetes-validate (dev extra) validates the manifest")
    found = docs()
    assert set(found) == {"PersistentVolumeClaim", "Job", "NetworkPolicy", "Deployment", "Service/wcache",
                          "Service/wcache-seed"}
    for kind, d in found.items():
        assert validate_k8s(d) == [], kind
    bad = copy.deepcopy(found["Deployment"])
    bad["spec"]["template"]["spec"]["securityContext"]["runAsNonRot"] = True
    assert any("runAsNonRot" in e for e in validate_k8s(bad))


def test_runs_as_a_non_root_user_without_privileges():
    spec = docs()["Deployment"]["spec"]["template"]["spec"]
    sc, csc = spec["securityContext"], container()["securityContext"]
    assert sc["runAsNonRoot"] is True and sc["runAsUser"] != 0 and sc["runAsGroup"] != 0
    assert sc["fsGroup"] == sc["runAsGroup"]  # the cache volume is writable for that user
    assert csc["allowPrivilegeEscalation"] is False and csc["capabilities"]["drop"] == ["ALL"]


def test_the_checkpoint_comes_from_the_claim_read_only():
    d = docs()
    spec = d["Deployment"]["spec"]["template"]["spec"]
    model = next(v for v in spec["volumes"] if v["name"] == "model")
    assert model["persistentVolumeClaim"]["claimName"] == d["PersistentVolumeClaim"]["metadata"]["name"]
    mount = next(m for m in container()["volumeMounts"] if m["name"] == "model")
    env = {e["name"]: e for e in container()["env"]}
    assert mount["readOnly"] is True and mount["mountPath"] == env["MODEL_DIR"]["value"]


def test_state_timeout_equals_the_startup_probe_budget():
    c = container()
    config = json.loads(re.search(r"--model-loader-extra-config '(\{.*?\})'", script(c)).group(1))
    probe = c["startupProbe"]
    assert config["fallback"] is False
    assert config["state_timeout_s"] == probe["periodSeconds"] * probe["failureThreshold"]


def test_seeding_ports_token_and_service_agree():
    d, c = docs(), container()
    s = script(c)
    listen_port = int(re.search(r"--weight-cache-seed-listen 0\.0\.0\.0:(\d+)", s).group(1))
    host, seed_port = re.search(r"--weight-cache-seed (\S+):(\d+)", s).groups()
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports["seed"] == listen_port
    svc = d[f"Service/{host}"]
    assert svc["spec"]["selector"] == d["Deployment"]["spec"]["template"]["metadata"]["labels"]
    (p,) = svc["spec"]["ports"]
    assert p["port"] == int(seed_port) and p["targetPort"] == "seed"
    token = {e["name"]: e for e in c["env"]}["WCACHE_SEED_TOKEN"]
    assert token["valueFrom"]["secretKeyRef"] == {"name": "wcache-seed", "key": "token"}
    assert "--weight-cache-seed-token" not in s  # never on the command line


def test_every_engine_takes_its_api_key_from_a_secret():
    """Each manifest's engine container reads VLLM_API_KEY (vLLM's variable) from the Secret
    wcache-api-key, never from a value in the file or a flag on its command line."""
    engines = [("k8s-deployment.yaml", container()), ("k8s-pod.yaml", yaml.safe_load(POD.read_text())["spec"]["containers"][0])]
    pods = [d for d in yaml.safe_load_all((POD.parent / "k8s-pod-isolated.yaml").read_text()) if d and d["kind"] == "Pod"]
    isolated = pods[0]["spec"]["containers"]
    engines.append(("k8s-pod-isolated.yaml", next(c for c in isolated if c["name"] == "engine")))
    for name, c in engines:
        key = {e["name"]: e for e in c.get("env", [])}.get("VLLM_API_KEY")
        assert key is not None, f"{name}: the engine serves without an API key"
        assert key == {"name": "VLLM_API_KEY", "valueFrom": {"secretKeyRef": {"name": "wcache-api-key", "key": "key"}}}, name
        assert "--api-key" not in " ".join(c.get("command", []) + c.get("args", [])), name


def test_the_network_policy_admits_only_clients_to_the_engine_and_replicas_to_the_seed_port():
    """No ingress rule without a `from` (which would admit every source); the engine's port only from
    pods labelled wcache-client, the seed port only from other replicas, the health port from none."""
    d = docs()
    policy = d["NetworkPolicy"]["spec"]
    labels = d["Deployment"]["spec"]["template"]["metadata"]["labels"]
    admitted = {}
    for rule in policy["ingress"]:
        assert rule.get("from"), f"an ingress rule open to every source: {rule}"
        for port in rule["ports"]:
            admitted[port["port"]] = [peer["podSelector"]["matchLabels"] for peer in rule["from"]]
    assert admitted == {"http": [{"wcache-client": "true"}], "seed": [labels]}


def test_the_container_is_the_pods_plus_the_documented_additions():
    pod = yaml.safe_load(POD.read_text())["spec"]["containers"][0]
    c = container()
    for key in ("image", "command", "ports", "startupProbe", "livenessProbe", "readinessProbe", "resources"):
        if key == "ports":
            assert [p for p in c["ports"] if p["name"] != "seed"] == pod["ports"]
        else:
            assert c[key] == pod[key], key
    # The script: the pod's, with the seeding flags on preload (state_timeout_s is the pod's too).
    mine = c["args"][0]
    mine = re.sub(r" \\\n\s+--weight-cache-seed-listen \S+ --weight-cache-seed \S+", "", mine)
    strip = lambda text: [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.strip().startswith("#")]
    assert strip(mine) == strip(pod["args"][0])


@pytest.mark.slow
def test_a_replica_serves_and_its_engine_worker_is_respawned_in_place(tiny_model, tmp_path):
    """The Deployment's container script under its probes (the harness runs Pods, so its template
    becomes one). Seeding has no source here: the daemon logs why and tunes itself."""
    if os.geteuid() != 0:
        pytest.skip("probe harness: needs root for a private network namespace (the spec's ports, no collisions)")
    d = docs()["Deployment"]
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "wcache-replica"}, "spec": d["spec"]["template"]["spec"]}
    spec_file = tmp_path / "replica-pod.yaml"
    spec_file.write_text(yaml.safe_dump(pod))
    short = Path(tempfile.mkdtemp(prefix="wck-", dir="/tmp"))
    report, log = tmp_path / "probes.jsonl", tmp_path / "container.log"
    env_args = [f"MODEL_DIR={tiny_model}", f"TMPDIR={short}", f"WCACHE_CACHE_ROOT={tmp_path / 'cache'}",
                "WCACHE_SEED_TOKEN=0123456789abcdef0123", "VLLM_API_KEY=the-secret-s-key",
                f"PATH={Path(sys.executable).parent}:{os.environ.get('PATH', '/usr/bin:/bin')}"]
    argv = [sys.executable, str(HARNESS), str(spec_file), "--report", str(report), "--log", str(log)]
    argv += [a for e in env_args for a in ("--env", e)]
    argv += [a for s in RESPAWN_STEPS for a in ("--step", s)]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    out = log.read_text(errors="replace") if log.exists() else ""
    assert r.returncode == 0, f"harness failed:\n{r.stdout}\n{r.stderr}\ncontainer log:\n{out[-6000:]}"
    events = [json.loads(line) for line in report.read_text().splitlines()]
    check_respawn(events, out)
    assert "Cannot reach the weight cache seed at wcache-seed:47100" in out
    assert "Rank 0 serves its autotune cache to seeding replicas on 0.0.0.0:47100" in out
