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
import os
import shutil

import pytest
import yaml

# A dev extra (pyproject's dev dependencies): without it the module is skipped with this reason,
# so `pytest tests -m gpu` collects on a GPU host that has only the runtime packages.
kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="needs the dev extra kubernetes-validate")
from dockerlib import ROOT

from wcache import errors
from wcache.engine.loading.config import parse_loader_config

POD = ROOT / "examples" / "k8s-pod-isolated.yaml"
COMPOSE = ROOT / "examples" / "compose-isolated.yaml"
VERSIONS = ["1.34.0", "1.35.0", "1.36.0", "1.37.0"]


def docs() -> dict[str, dict]:
    return {d["kind"]: d for d in yaml.safe_load_all(POD.read_text()) if d}


def containers() -> tuple[dict, dict]:
    spec = docs()["Pod"]["spec"]
    (_verify, daemon), (engine,) = spec["initContainers"], spec["containers"]
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
    sidecar = bad["spec"]["initContainers"][1]
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
    shared = {"model": "/models/llama", "sockets": "/run/wcache", "cache": "/var/cache/wcache"}
    assert mounts[0] == {**shared, "daemon-tmp": "/tmp"} and mounts[1] == {**shared, "engine-tmp": "/tmp"}
    volumes = {v["name"]: v for v in spec["volumes"]}
    for name in ("sockets", "cache", "daemon-tmp", "engine-tmp"):
        assert set(volumes[name]["emptyDir"]) == {"sizeLimit"}, volumes[name]  # on disk, capped
    assert "/dev/shm" not in {m["mountPath"] for c in (daemon, engine) for m in c["volumeMounts"]}
    # One GPU claim, listed by both containers; no device-plugin GPU, which only one container could get.
    assert [c["name"] for c in spec["resourceClaims"]] == ["gpu"]
    assert spec["resourceClaims"][0]["resourceClaimTemplateName"] == docs()["ResourceClaimTemplate"]["metadata"]["name"]
    rct = docs()["ResourceClaimTemplate"]["spec"]["spec"]["devices"]["requests"]
    assert [r["exactly"]["deviceClassName"] for r in rct] == ["gpu.nvidia.com"]  # NVIDIA's DRA driver
    for c in (daemon, engine):
        assert c["resources"]["claims"] == [{"name": "gpu"}], c["resources"]
        assert "nvidia.com/gpu" not in c["resources"]["limits"]


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
    # The engine waits for a restarting daemon exactly as long as its startup probe lets it.
    probe = engine["startupProbe"]
    assert config["state_timeout_s"] == probe["periodSeconds"] * probe["failureThreshold"]
    # The engine restarts alone: the kubelet restarts it on exit or when its liveness probe fails
    # (the pod's restartPolicy, Always by default); no --respawn inside it.
    assert docs()["Pod"]["spec"].get("restartPolicy", "Always") == "Always"
    assert engine["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert "--respawn" not in engine["args"]
    assert f"--weight-cache-socket-dir={config['socket_dir']}" in daemon["args"]
    sockets = {m["name"]: m["mountPath"] for m in daemon["volumeMounts"]}["sockets"]
    assert config["socket_dir"].startswith(sockets + "/")  # on the shared emptyDir


def test_same_command_lines_as_the_compose_file_that_ci_runs():
    compose = yaml.safe_load(COMPOSE.read_text())["services"]
    daemon, engine = containers()

    # Compose runs on the host's network, so it binds both ports to loopback; a pod has its own
    # network namespace, where the kubelet's probes and the Service need the pod's address.
    host_only = {"--host=127.0.0.1", "--weight-cache-health-host=127.0.0.1"}

    def norm(args: list[str]) -> list[str]:
        out = []
        for a in args:
            if a in host_only:
                continue
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
    assert {k: v for k, v in loader_config(engine).items() if k != "state_timeout_s"} == ci_config


# -- The pod for real: its containers on Docker, as the kubelet lays them out (tests/docker/podrun.py).

HEALTH = ("import sys, urllib.request\ntry:\n    print(urllib.request.urlopen('http://127.0.0.1:' + sys.argv[1] + '/health', timeout=3).status)\n"
          "except Exception as e:\n    print(e)")
API_KEY = "pod-test-key"  # the Secret wcache-api-key's value, as `kubectl create secret` would hold it
COMPLETE = ("import json, urllib.request\nreq = urllib.request.Request('http://127.0.0.1:8000/v1/completions', "
            "data=json.dumps({'prompt': 'Hello', 'max_tokens': 8}).encode(), headers={'Content-Type': 'application/json', "
            f"'Authorization': 'Bearer {API_KEY}'}})\n"
            "print(json.dumps(json.load(urllib.request.urlopen(req, timeout=60))['choices'][0]['token_ids']))")


@pytest.mark.docker
@pytest.mark.slow
def test_the_pod_runs_as_two_containers_that_share_only_the_volumes(docker_image, docker_model, tmp_path):
    """The verify init container, then the daemon sidecar until its startup probe's /health answers,
    then the engine, each as the spec says (uid 10001, read-only root, no capabilities, memory
    limit), in one network namespace and nothing else shared. The engine maps the weights across
    the containers (on CPU the vmm_fd flag means the memfd arena, passed by descriptor like
    vmm_fd's); killed, it is restarted alone and maps them again; the daemon keeps running.
    The GPU claim is the one thing left out (CI has no GPU): tests/gpu and docs/gpu-transports.md
    measure vmm_fd between containers on a GPU host."""
    from dockerlib import docker, inspect, logs, mapped_line, unique, wait_until
    from podrun import PodRun

    pod = docs()["Pod"]
    secrets = {("wcache-api-key", "key"): API_KEY}
    run = PodRun(pod, docker_image, docker_model, unique("wcp"), secrets=secrets)
    init, daemon = pod["spec"]["initContainers"]
    (engine,) = pod["spec"]["containers"]
    uid = pod["spec"]["securityContext"]["runAsUser"]
    try:
        run.start_pause()
        # The init container checks the checkpoint and exits 0; on a truncated copy it exits 1 and
        # says which shard (the pod would stop there).
        r = run.run(init, detach=False)
        assert r.returncode == 0 and "is complete" in r.stdout, r.stdout + r.stderr
        bad = tmp_path / "truncated"
        shutil.copytree(docker_model, bad)
        shard = sorted(bad.glob("*.safetensors"))[-1]
        shard.write_bytes(shard.read_bytes()[:-10])
        for p in [bad, *bad.iterdir()]:
            p.chmod(0o755 if p.is_dir() else 0o644)
        broken = PodRun(pod, docker_image, bad, run.name + "-bad", secrets=secrets)
        broken.start_pause()
        try:
            r = broken.run(init, detach=False)
            assert r.returncode == 1, r.stdout + r.stderr
            assert f"Checkpoint /models/llama is not usable: {shard.name}: the file is" in r.stderr, r.stderr
        finally:
            broken.remove()

        # The sidecar, then the engine once the daemon's /health (its startup probe) answers 200.
        assert run.run(daemon, restart=True).returncode == 0
        d = f"{run.name}-weight-cache"
        health = str(next(p["containerPort"] for p in daemon["ports"]))
        wait_until(lambda: run.exec_python("weight-cache", HEALTH, health).stdout.strip() == "200", 120,
                   "daemon /health 200 (the startup probe)", lambda: logs(d)[-6000:])
        assert run.run(engine, restart=True).returncode == 0
        e = f"{run.name}-engine"
        wait_until(lambda: run.exec_python("engine", HEALTH, "8000").stdout.strip() == "200", 120,
                   "engine /health 200", lambda: logs(e)[-6000:])
        log = logs(e)
        assert mapped_line() in log and "falling back" not in log, log
        assert "into a memfd arena" in logs(d)
        # The kubelet's emptyDir is writable by all, so the daemon does not trust a state directory
        # on it: no hand-back to a restarted daemon in this pod (docs/kubernetes.md says so).
        assert errors.ARENA_RECORD_UNSAFE.split("{dir}")[0] in logs(d)
        answer = run.exec_python("engine", COMPLETE).stdout.strip()
        assert answer.startswith("["), answer

        # As the spec says: its uid, a read-only root, no capabilities; one network namespace
        # (the pod's), but each container its own PID and IPC namespaces.
        for c in (d, e):
            assert docker("exec", c, "id", "-u").stdout.strip() == str(uid)
            assert docker("exec", c, "touch", "/probe", check=False).returncode != 0
            assert inspect(c)["HostConfig"]["ReadonlyRootfs"] is True
            assert inspect(c)["HostConfig"]["CapDrop"] == ["ALL"]
        ns = {c: docker("exec", c, "readlink", "/proc/self/ns/pid", "/proc/self/ns/ipc", "/proc/self/ns/net").stdout.split()
              for c in (d, e)}
        assert ns[d][0] != ns[e][0] and ns[d][1] != ns[e][1] and ns[d][2] == ns[e][2], ns
        assert "wcache serve" in docker("exec", e, "cat", "/proc/1/cmdline").stdout.replace("\0", " ")

        # The engine crashes: it is restarted alone and maps the weights again; the daemon runs on.
        before = inspect(d)
        os.kill(inspect(e)["State"]["Pid"], 9)
        wait_until(lambda: logs(e).count(mapped_line()) >= 2, 120, "the restarted engine maps again",
                   lambda: logs(e)[-6000:])
        wait_until(lambda: run.exec_python("engine", HEALTH, "8000").stdout.strip() == "200", 120,
                   "restarted engine /health 200", lambda: logs(e)[-6000:])
        after = inspect(d)
        assert after["State"]["Pid"] == before["State"]["Pid"] and after["RestartCount"] == 0
        assert inspect(e)["RestartCount"] >= 1
        assert run.exec_python("engine", COMPLETE).stdout.strip() == answer
    finally:
        run.remove()
