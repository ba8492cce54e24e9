"""Run a pod spec's container as a real process tree, and apply its probes the way the kubelet does.

No cluster is needed: the container's ``command`` + ``args`` run as a local process tree with the
container's ``env`` (on top of this process's environment, which plays the image's), and its
``startupProbe``, ``livenessProbe`` and ``readinessProbe`` are applied with their own
``httpGet`` path/port, ``initialDelaySeconds``, ``periodSeconds``, ``timeoutSeconds``,
``failureThreshold`` and ``successThreshold``:

* no liveness or readiness probe runs until the startup probe has succeeded once;
* a startup or liveness probe that fails ``failureThreshold`` times in a row gets the container
  restarted (SIGTERM to its first process, SIGKILL to all of it after
  ``terminationGracePeriodSeconds``), as does the container's exit (``restartPolicy: Always``),
  after the kubelet's back-off (10 s, doubling);
* the pod is Ready after ``successThreshold`` readiness successes in a row and stops being Ready
  after ``failureThreshold`` failures; a probe succeeds on an HTTP status from 200 to 399 within
  ``timeoutSeconds``.

What a node would also do and this harness does not: ``resources`` (e.g. ``nvidia.com/gpu``),
``volumes``/``volumeMounts`` and ``image`` are not applied; paths that differ outside a pod are
given with ``--env`` (printed). The ports are the spec's own: by default the harness moves itself
into a private network namespace with only a loopback interface (needs root), so the container
listens on exactly the ports the probes name, and nothing collides with the host's.

Steps (``--step``, in order) script what happens while the probes run:
``ready[=TIMEOUT]`` waits until a readiness probe succeeds after the step began (the pod is
Ready); ``kill=REGEX`` SIGKILLs the processes of the container, other than its first, whose
command line matches; ``restarted[=TIMEOUT]`` waits until the kubelet has restarted the
container (after a failed probe or an exit) and started it again; ``kill-oldest=REGEX`` SIGKILLs
only the longest-running of those processes (``wcache serve --respawn``'s serving worker, not its
spare); ``log=N:TEXT`` waits until the container's output holds TEXT N times; ``sleep=S``;
``stop`` deletes the pod (SIGTERM, grace period) and is implied at the end.

Every probe result, state change, restart and step goes to ``--report`` as JSON lines; steps
record the container's process tree (pid -> command line), so a test can tell which process was
replaced. Example::

    python tools/k8s_probe.py examples/k8s-pod.yaml --env MODEL_DIR=/tmp/tiny \\
        --step ready --step 'kill=wcache serve' --step ready --report /tmp/probe.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).parent))  # netns.py beside this file
import netns  # noqa: E402

#: The kubelet's crash back-off: 10 s, doubled for each restart, at most 5 minutes.
BACKOFF_S, BACKOFF_MAX_S = 10.0, 300.0
#: Defaults of a Kubernetes probe.
PROBE_DEFAULTS = {"initialDelaySeconds": 0, "periodSeconds": 10, "timeoutSeconds": 1,
                  "failureThreshold": 3, "successThreshold": 1}


class HarnessError(Exception):
    pass


def private_loopback() -> None:
    """Move this process into a new network namespace and bring its loopback up (needs root)."""
    try:
        netns.private_loopback()
    except netns.NamespaceError as e:
        raise HarnessError(f"{e}; run as root, or use --host-network") from None


def load_container(path: Path, name: str | None = None) -> tuple[dict, dict]:
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
    pods = [d for d in docs if isinstance(d, dict) and d.get("kind") == "Pod"]
    if len(pods) != 1:
        raise HarnessError(f"{path}: expected one Pod, found {len(pods)}")
    pod = pods[0]
    containers = pod["spec"]["containers"]
    if name:
        containers = [c for c in containers if c["name"] == name]
    if len(containers) != 1:
        raise HarnessError(f"{path}: pick one container with --container (have {[c['name'] for c in pod['spec']['containers']]})")
    return pod, containers[0]


@dataclass
class Probe:
    kind: str
    path: str
    port: int
    initial_delay: float
    period: float
    timeout: float
    failure_threshold: int
    success_threshold: int
    next_at: float = 0.0
    successes: int = 0
    failures: int = 0

    @classmethod
    def from_spec(cls, kind: str, spec: dict, container: dict) -> "Probe":
        if "httpGet" not in spec:
            raise HarnessError(f"{kind}: only httpGet probes are supported")
        s = {**PROBE_DEFAULTS, **spec}
        port = spec["httpGet"]["port"]
        if isinstance(port, str):
            named = {p.get("name"): p["containerPort"] for p in container.get("ports", [])}
            if port not in named:
                raise HarnessError(f"{kind}: port {port!r} is not a named port of the container ({sorted(named)})")
            port = named[port]
        return cls(kind, spec["httpGet"].get("path", "/"), int(port), s["initialDelaySeconds"], s["periodSeconds"],
                   s["timeoutSeconds"], s["failureThreshold"], s["successThreshold"])

    def check(self) -> tuple[bool, str]:
        url = f"http://127.0.0.1:{self.port}{self.path}"
        try:
            with urllib.request.urlopen(url, timeout=self.timeout) as r:
                return 200 <= r.status < 400, f"HTTP {r.status}"
        except urllib.error.HTTPError as e:
            return 200 <= e.code < 400, f"HTTP {e.code}"
        except (OSError, ValueError) as e:
            return False, type(e).__name__ + (f": {e.reason}" if hasattr(e, "reason") else f": {e}")


def session_processes(sid: int) -> dict[int, str]:
    """pid -> command line of every process in session ``sid`` (the container's process tree)."""
    out = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            fields = stat[stat.rindex(")") + 2:].split()
            if int(fields[3]) != sid or fields[0] == "Z":
                continue
            cmd = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        except (OSError, ValueError, IndexError):
            continue
        out[int(entry)] = cmd
    return out


STEPS = "ready[=S], kill=REGEX, kill-oldest=REGEX, log=N:TEXT, restarted[=S], sleep=S, stop"


def start_time(pid: int) -> int:
    """A process's start, in clock ticks since boot (/proc/PID/stat field 22)."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat[stat.rindex(")") + 2:].split()[19])


class Kubelet:
    def __init__(self, pod: dict, container: dict, env: dict[str, str], log: Path, report: Path | None):
        self.pod, self.container = pod, container
        self.grace = float(pod["spec"].get("terminationGracePeriodSeconds", 30))
        self.argv = list(container.get("command", [])) + list(container.get("args", []))
        if not self.argv:
            raise HarnessError("the container has no command: the image's entrypoint is not known here")
        self.env = {**os.environ, **{e["name"]: str(e.get("value", "")) for e in container.get("env", [])}, **env}
        self.log_path, self.report = log, (report.open("w") if report else None)
        self.log = log.open("ab")
        self.probes = {k: Probe.from_spec(k, container[p], container) for k, p in
                       (("startup", "startupProbe"), ("liveness", "livenessProbe"), ("readiness", "readinessProbe"))
                       if p in container}
        self.proc: subprocess.Popen | None = None
        self.restarts = 0
        self.started_ok = False
        self.ready = False
        self.t0 = time.monotonic()
        self.restart_at: float | None = None

    # -- records --------------------------------------------------------------------------------
    def event(self, kind: str, **fields) -> dict:
        ev = {"t": round(time.monotonic() - self.t0, 3), "event": kind, **fields}
        if self.report:
            self.report.write(json.dumps(ev) + "\n")
            self.report.flush()
        if kind != "probe" or not fields.get("ok"):
            print(f"[{ev['t']:8.2f}s] {kind} " + " ".join(f"{k}={v}" for k, v in fields.items() if k != "processes"),
                  flush=True)
        return ev

    def processes(self) -> dict[int, str]:
        return session_processes(self.proc.pid) if self.proc and self.proc.poll() is None else {}

    # -- container lifecycle ----------------------------------------------------------------------
    def start(self) -> None:
        self.proc = subprocess.Popen(self.argv, env=self.env, stdout=self.log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        self.started_ok, self.ready = False, False
        now = time.monotonic()
        for p in self.probes.values():
            p.successes = p.failures = 0
            p.next_at = now + p.initial_delay
        self.event("container_started", pid=self.proc.pid, restarts=self.restarts)

    def kill_container(self, why: str) -> int | None:
        """SIGTERM to the container's first process; SIGKILL to all of it after the grace period."""
        if self.proc is None:
            return None
        pid = self.proc.pid
        if self.proc.poll() is None:
            self.event("container_stopping", reason=why, grace_s=self.grace)
            os.kill(pid, signal.SIGTERM)
            try:
                self.proc.wait(self.grace)
            except subprocess.TimeoutExpired:
                self.event("container_sigkill", reason="grace period over")
        for p in session_processes(pid):  # what is left of the container, as a runtime would
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait()
        deadline = time.monotonic() + 10
        while session_processes(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        code = self.proc.returncode
        self.event("container_exited", code=code, reason=why)
        return code

    def schedule_restart(self, why: str) -> None:
        self.kill_container(why)
        delay = min(BACKOFF_S * 2 ** self.restarts, BACKOFF_MAX_S)
        self.restarts += 1
        self.set_ready(False, "container restarting")
        self.restart_at = time.monotonic() + delay
        self.event("restart_scheduled", reason=why, backoff_s=delay, restarts=self.restarts)

    def set_ready(self, ready: bool, why: str) -> None:
        if ready != self.ready:
            self.ready = ready
            self.event("ready" if ready else "not_ready", reason=why)

    # -- the kubelet's loop -----------------------------------------------------------------------
    def tick(self) -> list[dict]:
        """Run every probe that is due; return their results."""
        now = time.monotonic()
        if self.restart_at is not None:
            if now >= self.restart_at:
                self.restart_at = None
                self.start()
            return []
        if self.proc is not None and self.proc.poll() is not None:
            self.schedule_restart(f"container exited with {self.proc.returncode}")
            return []
        results = []
        active = ["startup"] if not self.started_ok and "startup" in self.probes else ["liveness", "readiness"]
        for kind in active:
            p = self.probes.get(kind)
            if p is None or now < p.next_at:
                continue
            ok, detail = p.check()
            p.next_at = max(p.next_at + p.period, time.monotonic())
            if ok:
                p.successes, p.failures = p.successes + 1, 0
            else:
                p.failures, p.successes = p.failures + 1, 0
            results.append(self.event("probe", probe=kind, ok=ok, detail=detail, failures=p.failures))
            if kind == "startup" and ok and p.successes >= 1:
                self.started_ok = True
                self.event("started", probe="startup")
                now2 = time.monotonic()
                for k in ("liveness", "readiness"):
                    if k in self.probes:
                        self.probes[k].next_at = now2 + self.probes[k].initial_delay
            elif kind in ("startup", "liveness") and p.failures >= p.failure_threshold:
                self.schedule_restart(f"{kind} probe failed {p.failures} times: {detail}")
                return results
            elif kind == "readiness":
                if ok and p.successes >= p.success_threshold:
                    self.set_ready(True, detail)
                elif not ok and p.failures >= p.failure_threshold:
                    self.set_ready(False, detail)
        if "startup" not in self.probes:
            self.started_ok = True
        if "readiness" not in self.probes and self.started_ok:
            self.set_ready(True, "no readiness probe")
        return results

    def run_until(self, predicate, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while True:
            for r in self.tick():
                if predicate(r):
                    return
            if time.monotonic() > deadline:
                raise HarnessError(f"{what}: not within {timeout:g} s")
            time.sleep(0.05)

    def step(self, step: str) -> None:
        name, _, arg = step.partition("=")
        if name == "ready":
            self.event("step", step=step)
            self.run_until(lambda r: r["probe"] == "readiness" and r["ok"] and self.ready, float(arg or 600), "ready")
            self.event("step_done", step=step, processes=self.processes())
        elif name == "kill":
            pattern = re.compile(arg)
            # Not the container's first process: killing that ends the container (and is the
            # container's exit, not a process dying inside it).
            victims = {pid: cmd for pid, cmd in self.processes().items()
                       if pid != self.proc.pid and pattern.search(cmd)}
            if not victims:
                raise HarnessError(f"kill: no process of the container matches {arg!r}: {self.processes()}")
            for pid in victims:
                os.kill(pid, signal.SIGKILL)
            self.event("step_done", step=step, killed=victims, processes=self.processes())
        elif name == "kill-oldest":
            pattern = re.compile(arg)
            matching = [pid for pid, cmd in self.processes().items() if pid != self.proc.pid and pattern.search(cmd)]
            if not matching:
                raise HarnessError(f"kill-oldest: no process of the container matches {arg!r}: {self.processes()}")
            victim = min(matching, key=start_time)
            os.kill(victim, signal.SIGKILL)
            self.event("step_done", step=step, killed={victim: self.processes().get(victim, "")},
                       processes=self.processes())
        elif name == "log":
            count, _, text = arg.partition(":")
            self.event("step", step=step)
            deadline = time.monotonic() + 600
            while self.log_path.read_text(errors="replace").count(text) < int(count):
                if time.monotonic() > deadline:
                    raise HarnessError(f"log: not {count} x {text!r} in the container log within 600 s")
                self.tick()
                time.sleep(0.05)
            self.event("step_done", step=step, processes=self.processes())
        elif name == "restarted":
            self.event("step", step=step)
            seen = self.restarts
            deadline = time.monotonic() + float(arg or 600)
            while not (self.restarts > seen and self.restart_at is None):
                if time.monotonic() > deadline:
                    raise HarnessError(f"restarted: the container was not restarted within {float(arg or 600):g} s")
                self.tick()
                time.sleep(0.05)
            self.event("step_done", step=step, restarts=self.restarts, processes=self.processes())
        elif name == "sleep":
            self.event("step", step=step)
            end = time.monotonic() + float(arg)
            while time.monotonic() < end:
                self.tick()
                time.sleep(0.05)
            self.event("step_done", step=step, processes=self.processes())
        elif name == "stop":
            self.event("step", step=step)
            code = self.kill_container("pod deleted")
            self.event("step_done", step=step, exit_code=code, restarts=self.restarts)
            self.proc = None
        else:
            raise HarnessError(f"unknown step {step!r} ({STEPS})")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("pod", type=Path)
    ap.add_argument("--container", default=None)
    ap.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                    help="set or override a container environment variable (paths that differ outside a pod)")
    ap.add_argument("--step", action="append", default=[], help=STEPS)
    ap.add_argument("--log", type=Path, default=Path("container.log"), help="the container's output")
    ap.add_argument("--report", type=Path, default=None, help="JSON lines: probes, state changes, steps")
    ap.add_argument("--host-network", action="store_true",
                    help="use the host's loopback instead of a private network namespace")
    args = ap.parse_args(argv)
    try:
        pod, container = load_container(args.pod, args.container)
        overrides = dict(e.split("=", 1) for e in args.env)
        if not args.host_network:
            private_loopback()
        k = Kubelet(pod, container, overrides, args.log, args.report)
        ignored = [key for key in ("resources", "volumeMounts", "image") if key in container]
        k.event("harness", pod=pod["metadata"]["name"], container=container["name"],
                network="host loopback" if args.host_network else "private loopback",
                env_overrides=overrides, not_applied=ignored + (["volumes"] if pod["spec"].get("volumes") else []),
                probes={n: {f: getattr(p, f) for f in ("path", "port", "initial_delay", "period", "timeout",
                                                        "failure_threshold", "success_threshold")}
                        for n, p in k.probes.items()})
        k.start()
        try:
            for s in args.step:
                k.step(s)
        finally:
            if k.proc is not None:
                k.step("stop")
    except HarnessError as e:
        print(f"k8s_probe: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
