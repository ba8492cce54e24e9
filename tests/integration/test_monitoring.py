"""A real Prometheus scrapes a real daemon and engines (docs/monitoring.md), and the guide's alert
rules and scrape configurations are checked by Prometheus' own promtool.

Prometheus is Debian's ``prometheus`` package (``prometheus`` and ``promtool``). ``make test``
installs it on CI (the Makefile's ``monitoring-deps``: no service is started by the install);
elsewhere these tests skip, saying so, when it is missing. Each Prometheus runs on loopback with a
temporary storage directory, from the configuration the guide shows
(examples/monitoring/prometheus.yml), changed only where a test must: the targets' ports (free
ones), a 1 s scrape and evaluation interval, and the rule file's absolute path.

Every value asserted changes with what the test does: a second engine raises the daemon's handoff
counter, an engine whose socket is missing falls back to disk and sets the fallback series (and the
guide's alert fires on it), a completion raises vLLM's counters, the daemon's stop drops ``up``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import yaml
from procs import complete, free_port, two_processes, wait_until

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples" / "monitoring"
CONFIG, K8S_CONFIG, RULES, RULE_TESTS = (EXAMPLES / n for n in ("prometheus.yml", "prometheus-kubernetes.yml",
                                                                "alerts.yml", "alerts_test.yml"))
MISSING = ("Debian's prometheus package is not installed (prometheus and promtool): `make test` installs it on "
           "CI (Makefile: monitoring-deps); elsewhere: apt-get install prometheus")


def binaries() -> tuple[str, str]:
    prometheus, promtool = shutil.which("prometheus"), shutil.which("promtool")
    if prometheus and promtool:
        return prometheus, promtool
    if os.environ.get("CI") == "true":  # the Makefile installs it there: missing is a failure, not a skip
        pytest.fail(MISSING)
    print(f"SKIP: {MISSING}")
    pytest.skip(MISSING)


@pytest.fixture(scope="module")
def promtool() -> str:
    return binaries()[1]


def run(*cmd: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=120, check=False)


# -- promtool: the rule file, its unit tests, the scrape configurations ---------------------------
def test_alert_rules_pass_promtool_check_and_their_unit_tests(promtool, tmp_path):
    r = run(promtool, "check", "rules", str(RULES))
    assert r.returncode == 0 and "SUCCESS: 5 rules found" in r.stdout, r.stdout + r.stderr
    r = run(promtool, "test", "rules", RULE_TESTS.name, cwd=EXAMPLES)
    assert r.returncode == 0 and "SUCCESS" in r.stdout, r.stdout + r.stderr
    # Negative controls: a rule file with the TTFT bound moved, or the fallback alert's series
    # misnamed, fails the same unit tests (they test the alerts, not just the syntax).
    for old, new in (("rate(vllm:time_to_first_token_seconds_bucket[5m]))) > 2",
                      "rate(vllm:time_to_first_token_seconds_bucket[5m]))) > 5"),
                     ("(wcache_engine_weights_fallback) == 1", "(wcache_engine_weight_fallback) == 1")):
        broken = tmp_path / old[:4]
        broken.mkdir()
        text = RULES.read_text()
        assert old in text
        (broken / "alerts.yml").write_text(text.replace(old, new))
        shutil.copy(RULE_TESTS, broken)
        r = run(promtool, "test", "rules", RULE_TESTS.name, cwd=broken)
        assert r.returncode != 0 and "FAILED" in r.stdout + r.stderr, (new, r.stdout)


def test_scrape_configurations_pass_promtool_check_config(promtool, tmp_path):
    r = run(promtool, "check", "config", str(CONFIG))
    assert r.returncode == 0 and "is valid prometheus config file syntax" in r.stdout, r.stdout + r.stderr
    # Debian's build of Prometheus leaves Kubernetes discovery out; the Kubernetes job is checked
    # with its discovery swapped for a file of the same targets (its relabelling is what it adds,
    # and test_kubernetes_relabelling_scrapes_the_engine_and_the_daemon runs that).
    k8s = swap_kubernetes_discovery(yaml.safe_load(K8S_CONFIG.read_text()), tmp_path / "pods.json", [])
    (tmp_path / "k8s.yml").write_text(yaml.safe_dump(k8s))
    shutil.copy(RULES, tmp_path)
    r = run(promtool, "check", "config", str(tmp_path / "k8s.yml"))
    assert r.returncode == 0 and "is valid prometheus config file syntax" in r.stdout, r.stdout + r.stderr
    # Negative control: a mistyped relabel action is refused by the same check.
    k8s["scrape_configs"][0]["relabel_configs"][0]["action"] = "kep"
    (tmp_path / "bad.yml").write_text(yaml.safe_dump(k8s))
    assert run(promtool, "check", "config", str(tmp_path / "bad.yml")).returncode != 0


def swap_kubernetes_discovery(config: dict, pods_file: Path, pods: list[dict]) -> dict:
    """``config`` with each job's Kubernetes pod discovery replaced by ``pods_file``, which holds
    ``pods`` as that discovery would list them: one target per declared container port, labelled
    with the pod's ``__meta_kubernetes_*`` labels (Prometheus' kubernetes_sd_config, role pod)."""
    groups = []
    for pod in pods:
        meta = {"__meta_kubernetes_namespace": "default", "__meta_kubernetes_pod_name": pod["name"],
                "__meta_kubernetes_pod_ip": pod["ip"]}
        for key, value in pod["annotations"].items():
            name = "".join(c if c.isalnum() else "_" for c in key)
            meta[f"__meta_kubernetes_pod_annotation_{name}"] = value
            meta[f"__meta_kubernetes_pod_annotationpresent_{name}"] = "true"
        for port_name, port in pod["ports"].items():
            groups.append({"targets": [f"{pod['ip']}:{port}"],
                           "labels": {**meta, "__meta_kubernetes_pod_container_port_name": port_name,
                                      "__meta_kubernetes_pod_container_port_number": str(port)}})
    pods_file.write_text(json.dumps(groups))
    for job in config["scrape_configs"]:
        assert job.pop("kubernetes_sd_configs") == [{"role": "pod"}], job["job_name"]
        job["file_sd_configs"] = [{"files": [str(pods_file)], "refresh_interval": "1s"}]
    return config


# -- a real Prometheus ---------------------------------------------------------------------------
class Prometheus:
    def __init__(self, binary: str, config: dict, workdir: Path):
        self.port = free_port()
        workdir.mkdir(parents=True, exist_ok=True)
        config["global"].update(scrape_interval="1s", evaluation_interval="1s")
        config["rule_files"] = [str(RULES)]
        (workdir / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.log = workdir / "prometheus.log"
        with self.log.open("wb") as log:
            self.proc = subprocess.Popen(
                [binary, f"--config.file={workdir / 'prometheus.yml'}", f"--storage.tsdb.path={workdir / 'data'}",
                 f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        wait_until(lambda: self._get("/-/ready") is not None, 60, "Prometheus ready", self.tail)

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:]

    def _get(self, path: str):
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=5) as r:
                return r.read()
        except OSError:
            if self.proc.poll() is not None:
                raise AssertionError(f"Prometheus exited with {self.proc.returncode}:\n{self.tail()}") from None
            return None

    def query(self, promql: str) -> dict[tuple, float]:
        """{sorted label items (without __name__): value} of an instant query."""
        body = self._get("/api/v1/query?" + urllib.parse.urlencode({"query": promql}))
        if body is None:
            return {}
        out = {}
        for s in json.loads(body)["data"]["result"]:
            labels = tuple(sorted((k, v) for k, v in s["metric"].items() if k != "__name__"))
            out[labels] = float(s["value"][1])
        return out

    def value(self, promql: str) -> float | None:
        """The value of a query that names one series; None while it has none."""
        result = self.query(promql)
        assert len(result) <= 1, f"{promql} matched {len(result)} series: {result}"
        return next(iter(result.values()), None)

    def wait_value(self, promql: str, want: float, timeout: float = 60.0) -> None:
        wait_until(lambda: self.value(promql) == want, timeout, f"{promql} == {want}",
                   lambda: f"it is {self.query(promql)}\n{self.tail()}")

    def firing(self) -> list[dict]:
        body = self._get("/api/v1/alerts")
        return [a for a in json.loads(body)["data"]["alerts"] if a["state"] == "firing"] if body else []

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def guide_config(engine_ports: list[int], daemon_port: int) -> dict:
    """examples/monitoring/prometheus.yml with this test's ports."""
    config = yaml.safe_load(CONFIG.read_text())
    jobs = {j["job_name"]: j for j in config["scrape_configs"]}
    assert set(jobs) == {"wcache-engine", "wcache-daemon"}
    assert jobs["wcache-engine"]["static_configs"] == [{"targets": ["127.0.0.1:8000"]}]
    assert jobs["wcache-daemon"]["static_configs"] == [{"targets": ["127.0.0.1:8001"]}]
    jobs["wcache-engine"]["static_configs"] = [{"targets": [f"127.0.0.1:{p}" for p in engine_ports]}]
    jobs["wcache-daemon"]["static_configs"] = [{"targets": [f"127.0.0.1:{daemon_port}"]}]
    return config


@pytest.fixture
def prometheus_bin() -> str:
    return binaries()[0]


def test_prometheus_scrapes_the_daemon_and_engines(prometheus_bin, procs, tiny_model, tmp_path):
    health = free_port()
    first, second, fallback = free_port(), free_port(), free_port()
    prom = Prometheus(prometheus_bin, guide_config([first, second, fallback], health), tmp_path / "prom")
    try:
        daemon = procs.preload(tiny_model, "--weight-cache-health-host", "127.0.0.1",
                               "--weight-cache-health-port", str(health))
        engine = procs.serve(tiny_model, "--load-format", "ipc_cache", port=first)
        d, e1 = f'instance="127.0.0.1:{health}"', f'instance="127.0.0.1:{first}"'
        prom.wait_value(f'up{{job="wcache-daemon",{d}}}', 1)
        prom.wait_value(f"wcache_daemon_ready{{{d}}}", 1)
        prom.wait_value(f'wcache_daemon_handoffs_total{{{d},mode="zero_copy"}}', 1)
        held = prom.value(f"wcache_daemon_weights_bytes{{{d}}}")
        assert held and held > 1e6, held
        prom.wait_value(f'wcache_engine_weights_info{{{e1},source="ipc_cache",mode="zero_copy",transport="memfd",'
                        f'load_format="ipc_cache"}}', 1)
        assert prom.value(f"wcache_engine_weights_mapped_bytes{{{e1}}}") == held
        prom.wait_value(f"wcache_engine_daemon_alive{{{e1}}}", 1)
        assert prom.query("wcache_engine_weights_fallback") == {}

        # A completion: vLLM's counters and histograms move, with its labels.
        complete(engine.port, max_tokens=6)
        prom.wait_value(f'vllm:request_success_total{{{e1},finished_reason="length",engine="0"}}', 1)
        assert prom.value(f"vllm:generation_tokens_total{{{e1}}}") == 6
        assert prom.value(f"vllm:time_to_first_token_seconds_count{{{e1}}}") == 1
        assert prom.value(f"vllm:e2e_request_latency_seconds_count{{{e1}}}") == 1

        # A second engine: the daemon's handoff counter rises.
        procs.serve(tiny_model, "--load-format", "ipc_cache",
                    "--model-loader-extra-config", '{"mode": "copy"}', port=second)
        prom.wait_value(f'wcache_daemon_handoffs_total{{{d},mode="copy"}}', 1)
        # Its copy made, it asks the daemon to free its memory: refused while the first engine maps it.
        prom.wait_value(f'wcache_daemon_refusals_total{{{d},reason="in_use"}}', 1)
        assert prom.value(f'wcache_daemon_handoffs_total{{{d},mode="zero_copy"}}') == 1

        # An engine whose daemon socket does not exist falls back to disk: the fallback series is
        # set with its reason, the guide's alert fires, and the daemon refused nothing.
        e3 = f'instance="127.0.0.1:{fallback}"'
        procs.serve(tiny_model, "--load-format", "ipc_cache", "--model-loader-extra-config",
                    json.dumps({"socket_path": str(tmp_path / "absent.sock")}), port=fallback)
        prom.wait_value(f'wcache_engine_weights_fallback{{{e3},reason="no_socket"}}', 1)
        assert prom.value(f'wcache_engine_weight_fallbacks_total{{{e3},reason="no_socket"}}') == 1
        assert prom.value(f'wcache_engine_weights_info{{{e3}}}') == 1
        assert prom.query(f'wcache_engine_weights_info{{{e3},source="disk",mode="none",transport="none"}}')
        wait_until(lambda: any(a["labels"]["alertname"] == "WcacheEngineFellBackToDisk"
                               and a["labels"].get("reason") == "no_socket" for a in prom.firing()),
                   60, "the fallback alert firing", lambda: json.dumps(prom.firing()))
        assert [a["labels"]["instance"] for a in prom.firing()
                if a["labels"]["alertname"] == "WcacheEngineFellBackToDisk"] == [f"127.0.0.1:{fallback}"]

        # The daemon stops: its target is down, and the zero_copy engine sees its daemon gone.
        assert daemon.stop() == 0
        prom.wait_value(f'up{{job="wcache-daemon",{d}}}', 0)
        prom.wait_value(f"wcache_engine_daemon_alive{{{e1}}}", 0)
        assert prom.value(f'up{{job="wcache-engine",{e1}}}') == 1
    finally:
        prom.stop()


def test_kubernetes_relabelling_scrapes_the_engine_and_the_daemon(prometheus_bin, procs, tiny_model, tmp_path):
    """The Kubernetes job's relabelling, run by a real Prometheus on a pod as Kubernetes discovery
    lists it: the annotations of examples/k8s-*.yaml, and the container ports named as there."""
    health, port = free_port(), free_port()
    pods = [{"name": "wcache-0", "ip": "127.0.0.1", "ports": {"http": port, "weight-cache": health, "seed": free_port()},
             "annotations": {"prometheus.io/scrape": "true", "prometheus.io/port": str(port),
                             "prometheus.io/path": "/metrics"}}]
    config = swap_kubernetes_discovery(yaml.safe_load(K8S_CONFIG.read_text()), tmp_path / "pods.json", pods)
    prom = Prometheus(prometheus_bin, config, tmp_path / "prom")
    try:
        procs.preload(tiny_model, "--weight-cache-health-host", "127.0.0.1", "--weight-cache-health-port", str(health))
        procs.serve(tiny_model, "--load-format", "ipc_cache", port=port)
        prom.wait_value('wcache_engine_ready{job="wcache-engine"}', 1)
        prom.wait_value('wcache_daemon_ready{job="wcache-daemon"}', 1)
        # One target per job, each at its own port (the seed port and the other port are not scraped).
        assert prom.query("up") == {
            (("instance", f"127.0.0.1:{port}"), ("job", "wcache-engine"), ("namespace", "default"), ("pod", "wcache-0")): 1,
            (("instance", f"127.0.0.1:{health}"), ("job", "wcache-daemon"), ("namespace", "default"),
             ("pod", "wcache-0")): 1}
    finally:
        prom.stop()


@pytest.mark.parametrize("manifest", ["k8s-pod.yaml", "k8s-deployment.yaml", "k8s-pod-isolated.yaml"])
def test_kubernetes_manifests_carry_the_annotations_the_scrape_job_reads(manifest):
    """The pods of the guide's manifests are found by prometheus-kubernetes.yml: scraped, on the
    engine's port (the container port named http), at /metrics."""
    docs = [d for d in yaml.safe_load_all((ROOT / "examples" / manifest).read_text()) if d]
    pods = [d.get("spec", {}).get("template", d) for d in docs if d.get("kind") in ("Pod", "Deployment")]
    assert pods, manifest
    for pod in pods:
        annotations = pod.get("metadata", {}).get("annotations") or {}
        if "prometheus.io/scrape" not in annotations:
            reason = f"{manifest} has no prometheus.io annotations yet (the [deploy-2] change adds them)"
            print(f"SKIP: {reason}")
            pytest.skip(reason)
        # Kubernetes discovery lists init containers' ports too: the isolated pod's daemon is a sidecar.
        containers = pod["spec"]["containers"] + pod["spec"].get("initContainers", [])
        ports = {p["name"]: p["containerPort"] for c in containers for p in c.get("ports", [])}
        assert annotations["prometheus.io/scrape"] == "true"
        assert annotations["prometheus.io/path"] == "/metrics"
        assert int(annotations["prometheus.io/port"]) == ports["http"]
        assert "weight-cache" in ports


# -- the servers' own /metrics, without Prometheus -------------------------------------------------
NO_TUNE = "--no-enable-autotune"


def scrape(port: int) -> dict[str, dict[tuple, float]]:
    """{sample name: {sorted label items: value}} of one GET /metrics, parsed by prometheus_client."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict[str, dict[tuple, float]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return out


def families(port: int) -> set[str]:
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        return {f.name for f in text_string_to_metric_families(r.read().decode())}


def one(port: int, name: str) -> float | None:
    """The value of a sample name that has one series (None while it has none)."""
    series = scrape(port).get(name, {})
    assert len(series) <= 1, f"{name}: {series}"
    return next(iter(series.values()), None)


def test_what_the_servers_export_is_what_the_tables_declare(procs, tiny_model):
    """The guide's tables come from METRICS (tools/doc_tables.py): every family a real engine and
    daemon export is declared there, and every declared engine family is exported."""
    from wcache.daemon.metrics import METRICS as DAEMON
    from wcache.engine.api_server.metrics import METRICS as ENGINE

    health = free_port()
    procs.preload(tiny_model, NO_TUNE, "--weight-cache-health-host", "127.0.0.1", "--weight-cache-health-port",
                  str(health))
    engine = procs.serve(tiny_model, "--load-format", "ipc_cache", NO_TUNE)
    complete(engine.port)
    assert families(engine.port) == {m.name for m in ENGINE}
    exported = families(health)
    # A counter that never counted has no series in multiprocess mode (no adoption, no seed request).
    assert {"wcache_daemon_ready", "wcache_daemon_weights_bytes", "wcache_daemon_handoffs",
            "wcache_daemon_standby_waiting"} <= exported <= {m.name for m in DAEMON}


def test_a_waiting_standby_and_its_adoption_are_reported(procs, tiny_model, wcache_env):
    """The running daemon counts the standby blocked on its lock; the standby, once it has taken
    over and adopted the engine's arena, answers the same health port and counts the adoption."""
    from itest import default_socket
    from wcache.errors import STANDING_BY

    health = free_port()
    port_args = ("--weight-cache-health-host", "127.0.0.1", "--weight-cache-health-port", str(health))
    first = procs.preload(tiny_model, NO_TUNE, *port_args)
    engine = procs.serve(tiny_model, "--load-format", "ipc_cache", NO_TUNE)
    assert one(health, "wcache_daemon_standby_waiting") == 0
    assert one(health, "wcache_daemon_adoptions_total") == 0  # counters start at 0, as Prometheus asks
    standby = procs.preload(tiny_model, NO_TUNE, "--weight-cache-standby", *port_args, ready=False)
    standby.wait_for_log(STANDING_BY.format(path=default_socket(wcache_env)), timeout=120)
    wait_until(lambda: one(health, "wcache_daemon_standby_waiting") == 1, 30, "the standby counted")

    first.kill_group()  # the launcher and its rank at once, as a crash would
    standby.wait_for_log("Weight cache daemon READY", timeout=60)
    wait_until(lambda: one(health, "wcache_daemon_adoptions_total") == 1, 30, "the adoption counted",
               lambda: str(scrape(health)))
    assert one(health, "wcache_daemon_standby_waiting") == 0
    assert one(health, "wcache_daemon_ready") == 1
    assert one(health, "wcache_daemon_weights_bytes") > 1e6
    # The engine maps the adopted arena, leased again from the new daemon.
    wait_until(lambda: one(engine.port, "wcache_engine_daemon_alive") == 1, 30, "the engine's lease again")
    # The engine was adopted, not handed weights again: its one handoff here is that lease (a
    # zero_copy get_state of the arena it already maps), none in copy mode. (Asserting 0 before the
    # lease raced it: the engine leases again as soon as the adopter serves.)
    handoffs = {dict(labels)["mode"]: v for labels, v in scrape(health)["wcache_daemon_handoffs_total"].items()}
    assert handoffs == {"zero_copy": 1, "copy": 0}, handoffs


def test_counters_outlive_a_respawned_worker(procs, tiny_model):
    """``serve --respawn``: the counters outlive the engine that died, so its successor serves them
    on (and the load counter sees both loads). Two processes (the default): the front holds them and
    counts the promoted core's load; one: the supervisor's workers share one multiprocess directory."""
    engine = procs.serve(tiny_model, "--respawn", NO_TUNE)
    for _ in range(2):
        complete(engine.port, max_tokens=3)
    success = "vllm:request_success_total"
    assert sum(scrape(engine.port)[success].values()) == 2
    assert sum(scrape(engine.port)["wcache_engine_weight_loads_total"].values()) == 1
    if two_processes():  # the front holds the counters and promotes a spare engine core
        worker = int(engine.log().split("engine core pid ")[1].split(")")[0])
        os.kill(worker, 9)
        engine.wait_for_log(f"after engine core pid {worker} died", timeout=120)
    else:
        worker = int(engine.log().split("engine worker pid ")[1].split()[0])
        os.kill(worker, 9)
        engine.wait_for_log("Respawned", timeout=120)
    complete(engine.port, max_tokens=3)
    after = scrape(engine.port)
    assert sum(after[success].values()) == 3
    assert sum(after["vllm:generation_tokens_total"].values()) == 9
    assert sum(after["vllm:e2e_request_latency_seconds_count"].values()) == 3
    assert sum(after["wcache_engine_weight_loads_total"].values()) == 2
    assert one(engine.port, "wcache_engine_ready") == 1
