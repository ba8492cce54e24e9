"""examples/k8s-pod-isolated.yaml: two containers of one pod that share only emptyDir volumes.

Validated strictly against the Kubernetes schemas (1.34, the first release with the DRA API
resource.k8s.io/v1 that the GPU claim uses, and the newest kubernetes-validate ships), and checked
for what makes it namespace-free: no hostIPC, hostPID or shareProcessNamespace, no shared /dev/shm,
the daemon as a sidecar, and both containers on one GPU claim. It is not run under
tools/k8s_probe.py, whose harness runs one container of a pod; the two command lines are the ones
that tests/docker/test_docker_isolated.py runs for real in two containers with nothing shared but
the volumes (examples/compose-isolated.yaml), which the last test checks.
"""

from __future__ import annotations

import copy
import json

import pytest
import yaml

# A dev extra (pyproject's dev dependencies): without it the module is skipped with this reason,
# so `pytest tests -m gpu` collects on a GPU host that has only the runtime packages.
kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="needs the dev extra kubernetes-validate")
from dockerlib import ROOT

from wcache.engine.loading.config import parse_loader_config

POD = ROOT / "examples" / "k8s-pod-isolated.yaml"
COMPOSE = ROOT / "examples" / "compose-isolated.yaml"
VERSIONS = ["1.34.0", "1.37.0"]


def docs() -> dict[str, dict]:
    return {d["kind"]: d for d in yaml.safe_load_all(POD.read_text()) if d}


def containers() -> tuple[dict, dict]:
    spec = docs()["Pod"]["spec"]
    (daemon,), (engine,) = spec["initContainers"], spec["containers"]
    return daemon, engine


def errors_of(doc: dict, version: str) -> list[str]:
    try:
        kubernetes_validate.validate(doc, version, strict=True)
    except kubernetes_validate.ValidationError as e:
        return [f"/{'/'.join(map(str, e.absolute_path))}: {e.message}"]
    except kubernetes_validate.SchemaNotFoundError as e:
        return [e.message]
    return []


def loader_config(engine: dict) -> dict:
    flag = "--model-loader-extra-config="
    (arg,) = [a for a in engine["args"] if a.startswith(flag)]
    return json.loads(arg[len(flag):])


@pytest.mark.parametrize("version", VERSIONS)
def test_isolated_pod_is_strictly_valid(version):
    d = docs()
    assert sorted(d) == ["Pod", "ResourceClaimTemplate"]
    for doc in d.values():
        assert errors_of(doc, version) == [], doc["kind"]
    # Strict means strict: a misspelt field is an error, not silently ignored.
    bad = copy.deepcopy(d["Pod"])
    sidecar = bad["spec"]["initContainers"][0]
    sidecar["livenessProbes"] = sidecar.pop("livenessProbe")
    assert any("livenessProbes" in e for e in errors_of(bad, version))


def test_the_guides_runner_version_cannot_validate_it():
    # Why docs/kubernetes.md marks this file instead of letting tools/docs_runner validate it: the
    # runner's schemas are Kubernetes 1.30, which has no resource.k8s.io/v1 and another Pod claim shape.
    d = docs()
    assert errors_of(d["ResourceClaimTemplate"], "1.30.0") and errors_of(d["Pod"], "1.30.0")


def test_nothing_is_shared_but_the_emptydir_volumes():
    spec = docs()["Pod"]["spec"]
    assert not {"hostIPC", "hostPID", "hostNetwork", "shareProcessNamespace"} & set(spec)
    daemon, engine = containers()
    mounts = [{m["name"]: m["mountPath"] for m in c["volumeMounts"]} for c in (daemon, engine)]
    assert mounts[0] == mounts[1] == {"model": "/models/llama", "sockets": "/run/wcache", "cache": "/var/cache/wcache"}
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes["sockets"]["emptyDir"] == {} and volumes["cache"]["emptyDir"] == {}
    assert "/dev/shm" not in {m["mountPath"] for c in (daemon, engine) for m in c["volumeMounts"]}
    # One GPU claim, listed by both containers; no device-plugin GPU, which only one container could get.
    assert [c["name"] for c in spec["resourceClaims"]] == ["gpu"]
    assert spec["resourceClaims"][0]["resourceClaimTemplateName"] == docs()["ResourceClaimTemplate"]["metadata"]["name"]
    for c in (daemon, engine):
        assert c["resources"] == {"claims": [{"name": "gpu"}]}, c["resources"]


def test_the_daemon_is_a_sidecar_and_the_probes_check_the_right_processes():
    daemon, engine = containers()
    assert daemon["restartPolicy"] == "Always"  # a sidecar: the engine starts after its startup probe
    ports = {p["name"]: p["containerPort"] for c in (daemon, engine) for p in c["ports"]}
    health = [a for a in daemon["args"] if a.startswith("--weight-cache-health-port=")]
    assert health == [f"--weight-cache-health-port={ports['weight-cache']}"]
    for probe in ("startupProbe", "livenessProbe"):
        assert daemon[probe]["httpGet"] == {"path": "/health", "port": "weight-cache"}
    assert f"--port={ports['http']}" in engine["args"]
    assert engine["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert "--weight-cache-transport=vmm_fd" in daemon["args"]
    config = loader_config(engine)
    parse_loader_config(config)  # the engine's own validation accepts it
    assert config["transport"] == "vmm_fd" and config["fallback"] is False
    assert f"--weight-cache-socket-dir={config['socket_dir']}" in daemon["args"]
    sockets = {m["name"]: m["mountPath"] for m in daemon["volumeMounts"]}["sockets"]
    assert config["socket_dir"].startswith(sockets + "/")  # on the shared emptyDir


def test_same_command_lines_as_the_compose_file_that_ci_runs():
    compose = yaml.safe_load(COMPOSE.read_text())["services"]
    daemon, engine = containers()

    def norm(args: list[str]) -> list[str]:
        out = []
        for a in args:
            a = a.replace("${HEALTH_PORT:-8001}", "8001").replace("${PORT:-8000}", "8000")
            out.append(a.replace("=/models/llama", "=/model").replace("/models/llama", "/model"))
        return out

    assert daemon["command"] == compose["weight-cache"]["entrypoint"]
    assert norm(daemon["args"]) == norm(compose["weight-cache"]["command"])
    flag = "--model-loader-extra-config="
    pod_engine = [a for a in norm(engine["args"]) if not a.startswith(flag)]
    ci_engine = [a for a in norm(compose["engine"]["command"]) if not a.startswith(flag)]
    assert pod_engine == ci_engine
    ci_config = json.loads(next(a for a in compose["engine"]["command"] if a.startswith(flag))[len(flag):])
    assert {k: v for k, v in loader_config(engine).items() if k != "fallback"} == ci_config
