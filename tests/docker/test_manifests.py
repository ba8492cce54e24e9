"""What docs/kubernetes.md and docs/docker.md claim of the deployment files, read from the files.

Each test fails when a file regresses: a container without requests equal to its limits (the
Guaranteed QoS class), a root or privileged container, a writable root filesystem, a memory-backed
volume without a size limit, a grace period shorter than the engine's drain, a daemon that stops
before its engine, a daemon Docker does not restart, an engine that falls back to disk where the
daemon is meant to be there, an API on every address of a host network, an image without its user
or health check. No cluster and no Docker engine: the files are parsed.
"""

from __future__ import annotations

import json
import re

import pytest
import yaml
from dockerlib import ROOT, logical_lines

EXAMPLES = ROOT / "examples"
MANIFESTS = ["k8s-pod.yaml", "k8s-pod-isolated.yaml", "k8s-deployment.yaml"]
COMPOSE = ["compose.yaml", "compose-scoped.yaml", "compose-isolated.yaml"]
SCRIPTS = ["docker-run.sh", "docker-run-isolated.sh"]
#: What the grace period leaves after the engine's drain, for the daemon's own stop.
DAEMON_STOP_MARGIN_S = 10


def dockerfile_uid() -> int:
    return int(re.search(r"^ARG WCACHE_UID=(\d+)$", (EXAMPLES / "Dockerfile").read_text(), re.M).group(1))


def pod_specs() -> list[tuple[str, dict, dict]]:
    """(file, object, pod spec) of every object that runs pods."""
    out = []
    for name in MANIFESTS:
        for d in yaml.safe_load_all((EXAMPLES / name).read_text()):
            if d and d["kind"] == "Pod":
                out.append((name, d, d["spec"]))
            elif d and d["kind"] in ("Deployment", "Job"):
                out.append((name, d, d["spec"]["template"]["spec"]))
    return out


def serving_pods() -> list[tuple[str, dict, dict]]:
    """The pods that run the daemon and the engine (not the copy Job), with their pod metadata."""
    out = []
    for name, obj, spec in pod_specs():
        if obj["kind"] == "Pod":
            out.append((name, obj["metadata"], spec))
        elif obj["kind"] == "Deployment":
            out.append((name, obj["spec"]["template"]["metadata"], spec))
    return out


def all_containers(spec: dict) -> list[dict]:
    return spec.get("initContainers", []) + spec["containers"]


def drain_defaults() -> tuple[float, float]:
    """The engine's --shutdown-delay and --shutdown-timeout defaults, from the serve parser itself.

    The contract with [ops-1] (the engine's drain): --shutdown-delay (default 5 s: the engine keeps
    accepting after SIGTERM while Kubernetes withdraws the endpoint) and --shutdown-timeout
    (default 30 s: the drain's deadline). Until the engine has them this fails, loudly: the grace
    periods below are sized for them."""
    try:
        from wcache.cli import build_parser
    except ImportError:
        from wcache.cli.parser import build_parser  # type: ignore[no-redef]
    parser = build_parser("serve")
    serve = next(a for a in parser._actions if a.dest == "command").choices["serve"]
    found = {opt: a.default for a in serve._actions for opt in a.option_strings}
    missing = [f for f in ("--shutdown-delay", "--shutdown-timeout") if f not in found]
    if missing:
        pytest.fail(f"`wcache serve` has no {' and no '.join(missing)} yet ([ops-1]'s drain flags): the "
                    "manifests' grace periods assume the contract's defaults, 5 s and 30 s", pytrace=False)
    return float(found["--shutdown-delay"]), float(found["--shutdown-timeout"])


@pytest.mark.parametrize("name", MANIFESTS)
def test_every_container_requests_what_it_is_limited_to(name):
    """Guaranteed QoS: every container (init containers and the sidecar included) requests exactly
    its CPU and memory limits, so the pod is the last to be evicted or OOM-killed under pressure."""
    for file, obj, spec in pod_specs():
        if file != name:
            continue
        for c in all_containers(spec):
            r = c["resources"]
            for key in ("cpu", "memory"):
                assert r["requests"][key] == r["limits"][key], (obj["kind"], c["name"], key)


def test_the_memory_limits_hold_what_was_measured():
    """Host memory that cannot be reclaimed (anonymous and shared; page cache can), from the H200
    records: the daemon's peak while loading (tools/docker/daemon_memory.py) and the engine under
    --respawn (its serving worker, spare and supervisor), with the margins docs/kubernetes.md gives."""
    daemon = json.loads((ROOT / "docs/benchmarks/deploy/2026-12-04-h200-daemon-memory-vmm_fd.json").read_text())
    peak = daemon["load_peaks_mib"]
    daemon_mib = peak["RssAnon"] + peak["RssShmem"]
    respawn = json.loads((ROOT / "docs/benchmarks/2026-12-03-h200-llama-8b-respawn.json").read_text())["respawn"]["memory"]
    serving_mib = respawn["serving_rss_bytes"] / 2**20
    engine_mib = (respawn["spare_rss_bytes"] + respawn["serving_rss_bytes"] + respawn["supervisor_rss_bytes"]) / 2**20
    mib = lambda q: int(q.removesuffix("Gi")) * 1024  # noqa: E731
    pod = yaml.safe_load((EXAMPLES / "k8s-pod.yaml").read_text())["spec"]
    (one,) = pod["containers"]
    shm = next(v for v in pod["volumes"] if v["name"] == "shm")["emptyDir"]["sizeLimit"]
    assert mib(one["resources"]["limits"]["memory"]) >= 1.2 * (daemon_mib + engine_mib) + mib(shm)
    isolated = [d for d in yaml.safe_load_all((EXAMPLES / "k8s-pod-isolated.yaml").read_text()) if d["kind"] == "Pod"][0]
    (_, sidecar), (engine,) = isolated["spec"]["initContainers"], isolated["spec"]["containers"]
    assert mib(sidecar["resources"]["limits"]["memory"]) >= 1.5 * daemon_mib
    assert mib(engine["resources"]["limits"]["memory"]) >= 2 * serving_mib


@pytest.mark.parametrize("name", MANIFESTS)
def test_no_root_no_privileges_read_only_root(name):
    uid = dockerfile_uid()
    for file, obj, spec in pod_specs():
        if file != name:
            continue
        sc = spec["securityContext"]
        # One fixed uid for the daemon and its engines: the socket checks require it.
        assert sc["runAsNonRoot"] is True and sc["runAsUser"] == sc["runAsGroup"] == sc["fsGroup"] == uid
        assert sc["seccompProfile"] == {"type": "RuntimeDefault"}
        assert spec["automountServiceAccountToken"] is False
        for c in all_containers(spec):
            csc = c["securityContext"]
            assert csc["allowPrivilegeEscalation"] is False and csc["capabilities"] == {"drop": ["ALL"]}, c["name"]
            assert csc["readOnlyRootFilesystem"] is True, c["name"]
            assert "runAsUser" not in csc or csc["runAsUser"] == uid


@pytest.mark.parametrize("name", MANIFESTS)
def test_every_emptydir_has_a_size_limit_and_memory_ones_fit_the_limit(name):
    for file, obj, spec in pod_specs():
        if file != name:
            continue
        volumes = {v["name"]: v for v in spec["volumes"]}
        for v in volumes.values():
            if "emptyDir" in v:
                assert "sizeLimit" in v["emptyDir"], (obj["kind"], v["name"])
        for c in all_containers(spec):
            for m in c.get("volumeMounts", []):
                e = volumes[m["name"]].get("emptyDir", {})
                if e.get("medium") == "Memory":  # tmpfs pages count toward the container's memory
                    assert int(e["sizeLimit"].removesuffix("Gi")) < int(c["resources"]["limits"]["memory"].removesuffix("Gi"))


@pytest.mark.parametrize("name", MANIFESTS)
def test_the_grace_period_covers_the_engines_drain_and_the_daemons_stop(name):
    delay, timeout = drain_defaults()
    for file, meta, spec in serving_pods():
        if file == name:
            assert spec["terminationGracePeriodSeconds"] >= delay + timeout + DAEMON_STOP_MARGIN_S


def engine_wait_s(container: dict) -> float | None:
    """The engine's wait for its daemon (``state_timeout_s``, else the loader's default) when the
    container runs ``wcache serve --load-format ipc_cache``; None for any other container."""
    from wcache.engine.loading.config import LOADER_KEYS

    text = "\n".join(container.get("command", []) + container.get("args", []))
    if not re.search(r"--load-format[= ]ipc_cache", text):
        return None
    m = re.search(r"--model-loader-extra-config[= ]'?(\{[^\n']*\})", text)
    config = json.loads(m.group(1)) if m else {}
    return float(config.get("state_timeout_s", LOADER_KEYS["state_timeout_s"]))


def startup_budget_s(container: dict) -> float:
    """How long the kubelet lets a container start before its startup probe fails it."""
    p = container.get("startupProbe")
    if not p:
        return 0.0
    return p.get("initialDelaySeconds", 0) + p.get("periodSeconds", 10) * p.get("failureThreshold", 3)


@pytest.mark.parametrize("name", MANIFESTS)
def test_the_engine_waits_for_the_daemon_as_long_as_the_startup_probes_allow(name):
    """With fallback off the engine waits state_timeout_s for the daemon, then exits 2. A wait
    shorter than the startup probe's budget makes a slow but healthy daemon's engine give up: the
    one-container script then stops the daemon, and the container crash-loops, loading from disk on
    every try (k8s-pod.yaml set none, so waited the default 300 s, beside a 900 s probe)."""
    for file, _, spec in serving_pods():
        if file != name:
            continue
        budget = max(startup_budget_s(c) for c in all_containers(spec))
        waits = [w for c in all_containers(spec) if (w := engine_wait_s(c)) is not None]
        assert waits and budget > 0, f"{name}: no engine with ipc_cache, or no startup probe"
        assert min(waits) >= budget, f"{name}: the engine waits {min(waits)} s, the startup probes allow {budget} s"


@pytest.mark.parametrize("name", ["k8s-pod.yaml", "k8s-deployment.yaml"])
def test_one_container_stops_the_engine_before_the_daemon(name):
    """The daemon must outlive the engine's drain (the engine serves from its memory): the script's
    SIGTERM trap stops the engine, waits for it, and only then stops the daemon."""
    (spec,) = [s for f, _, s in serving_pods() if f == name]
    script = spec["containers"][0]["args"][0]
    (trap,) = re.findall(r"^\s*trap '([^']*)' TERM INT$", script, re.M)
    steps = [s.strip() for s in trap.split(";")]
    assert steps[:4] == ["kill -TERM $engine 2>/dev/null", "wait $engine", "kill -TERM $daemon 2>/dev/null",
                         "wait $daemon"], steps


def test_two_containers_the_kubelet_stops_the_daemon_after_the_engine():
    """In the DRA pod the daemon is a sidecar (an init container with restartPolicy Always): the
    kubelet stops sidecars only after the pod's containers have exited (Kubernetes 1.29 and
    later; the DRA API needs 1.34), so no preStop is needed to keep it for the engine's drain."""
    (spec,) = [s for f, _, s in serving_pods() if f == "k8s-pod-isolated.yaml"]
    verify, daemon = spec["initContainers"]
    assert daemon["restartPolicy"] == "Always" and "restartPolicy" not in verify
    assert [c["name"] for c in spec["containers"]] == ["engine"]
    assert "preStop" not in json.dumps(spec)


@pytest.mark.parametrize("name", MANIFESTS)
def test_the_checkpoint_is_checked_before_the_daemon_loads_it(name):
    for file, meta, spec in serving_pods():
        if file != name:
            continue
        first = spec["initContainers"][0]
        assert first["command"][0] == "wcache-verify-checkpoint" and "restartPolicy" not in first
        model = next(m["mountPath"] for m in first["volumeMounts"] if m["name"] == "model")
        assert first["command"][1:] == [model]
        assert first["terminationMessagePolicy"] == "FallbackToLogsOnError"  # the reason in `kubectl describe`
    assert "COPY examples/verify_checkpoint.py /usr/local/bin/wcache-verify-checkpoint" in (EXAMPLES / "Dockerfile").read_text()


def test_the_copy_job_fills_the_claim_and_checks_the_hashes():
    objs = {d["kind"]: d for d in yaml.safe_load_all((EXAMPLES / "k8s-deployment.yaml").read_text())}
    pvc, job = objs["PersistentVolumeClaim"], objs["Job"]["spec"]["template"]["spec"]
    assert pvc["spec"]["storageClassName"] and pvc["spec"]["accessModes"] == ["ReadWriteMany"]
    (copy,) = job["containers"]
    claims = {v["name"]: v["persistentVolumeClaim"]["claimName"] for v in job["volumes"]}
    mounts = {m["name"]: m for m in copy["volumeMounts"]}
    assert claims["model"] == pvc["metadata"]["name"] and not mounts["model"].get("readOnly")
    script = copy["args"][0]
    assert f"cp -r /source/. {mounts['model']['mountPath']}/" in script
    assert "wcache-verify-checkpoint" in script and "--sha256" in script and "set -euo pipefail" in script


@pytest.mark.parametrize("name", MANIFESTS)
def test_engine_pods_are_scraped_on_the_engines_port(name):
    for file, meta, spec in serving_pods():
        if file != name:
            continue
        a = meta["annotations"]
        ports = {p["name"]: p["containerPort"] for c in all_containers(spec) for p in c.get("ports", [])}
        assert a["prometheus.io/scrape"] == "true" and a["prometheus.io/path"] == "/metrics"
        assert a["prometheus.io/port"] == str(ports["http"])


def _runs(script: str) -> dict[str, str]:
    runs = [ln.text for ln in logical_lines(script) if ln.text.lstrip().startswith("docker run")]
    return {("daemon" if "$NAME-daemon" in r else "engine"): r for r in runs}


@pytest.mark.parametrize("name", SCRIPTS)
def test_docker_run_restarts_both_binds_loopback_and_turns_fallback_off(name):
    runs = _runs((EXAMPLES / name).read_text())
    assert set(runs) == {"daemon", "engine"}
    for r in runs.values():
        assert " --restart always " in r and "--cap-drop ALL" in r and "--security-opt no-new-privileges" in r
        assert "--memory " in r and "--user" not in r  # the image's user
    assert "--weight-cache-health-host 127.0.0.1" in runs["daemon"]
    assert "--host 127.0.0.1" in runs["engine"] and '"fallback": false' in runs["engine"]
    assert int(re.search(r"--stop-timeout (\d+)", runs["engine"]).group(1)) >= 35 + DAEMON_STOP_MARGIN_S


@pytest.mark.parametrize("name", COMPOSE)
def test_compose_restarts_both_binds_loopback_and_turns_fallback_off(name):
    services = yaml.safe_load((EXAMPLES / name).read_text())["services"]
    daemon, engine = services["weight-cache"], services["engine"]
    for s in (daemon, engine):
        assert s["restart"] == "always" and s["cap_drop"] == ["ALL"] and s["mem_limit"] == s["mem_reservation"]
        assert s["security_opt"] == ["no-new-privileges:true"] and "user" not in s
    assert "--weight-cache-health-host=127.0.0.1" in daemon["command"]
    assert "--host=127.0.0.1" in engine["command"]
    flag = "--model-loader-extra-config="
    config = json.loads(next(a for a in engine["command"] if a.startswith(flag))[len(flag):])
    assert config["fallback"] is False
    assert int(engine["stop_grace_period"].removesuffix("s")) >= 35 + DAEMON_STOP_MARGIN_S
    assert engine["environment"]["WCACHE_HEALTH_URL"] == "http://127.0.0.1:${PORT:-8000}/health"


def test_the_image_has_its_user_a_health_check_and_the_measured_base():
    text = (EXAMPLES / "Dockerfile").read_text()
    uid = dockerfile_uid()
    assert uid >= 10000  # clear of the host's users (and checkov's CKV_K8S_40 in the manifests)
    assert re.search(r"^USER \$\{WCACHE_UID\}:\$\{WCACHE_UID\}$", text, re.M)
    assert re.search(r"^HEALTHCHECK .*--start-period=\S+", text, re.M)
    assert "WCACHE_HEALTH_URL" in text.split("HEALTHCHECK", 1)[1]
    base = re.search(r"^ARG BASE_IMAGE=(\S+)$", text, re.M).group(1)
    # The PyTorch and CUDA of the GPU measurements (docs/validation.md: torch 2.11.0+cu130).
    torch, cuda = re.search(r"PyTorch (\d+\.\d+\.\d+)\+cu(\d+)", (ROOT / "docs/validation.md").read_text()).groups()
    assert base == f"pytorch/pytorch:{torch}-cuda{cuda[:-1]}.{cuda[-1]}-cudnn9-runtime", base
