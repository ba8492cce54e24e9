"""The Kubernetes manifests in examples/ give a pod time for the engine's whole SIGTERM drain
(engine/api_server/drain.py, docs/lifecycle.md#stopping-the-engine): ``terminationGracePeriodSeconds`` covers
a preStop hook's sleep, ``--shutdown-delay``, ``--shutdown-timeout`` (the manifest's own values, else
the flags' defaults) and a margin for the engine's own stop. Kubernetes sends SIGKILL at the grace
period's end, so a shorter one would cut the drain."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest
import yaml

from wcache.cli.flags import add_preload_args
from wcache.engine.api_server.drain import SHUTDOWN_DELAY_S, SHUTDOWN_TIMEOUT_S


def _preload_default(dest: str) -> float:
    """A `wcache preload` flag's default, from its parser."""
    parser = argparse.ArgumentParser()
    add_preload_args(parser)
    return float(parser.get_default(dest))


ROOT = Path(__file__).resolve().parents[2]
MANIFESTS = sorted((ROOT / "examples").glob("k8s-*.yaml"))
STOP_MARGIN_S = 10  # the engine's own stop after the drain (the respawn supervisor's STOP_GRACE_S)
STOP_TIMEOUT_S = _preload_default("weight_cache_stop_timeout")
DAEMON_MARGIN_S = 5  # after its stop timeout: the launcher's kill, the socket's removal, its exit


def pod_specs(path: Path):
    for doc in yaml.safe_load_all(path.read_text(encoding="utf-8")):
        if not isinstance(doc, dict):
            continue
        spec = doc.get("spec") or {}
        if "template" in spec:
            spec = spec["template"].get("spec") or {}
        if "containers" in spec:
            yield spec


def flag(text: str, name: str, default: float) -> float:
    m = re.search(rf"{name}[ =]([0-9.]+)", text)
    return float(m.group(1)) if m else default


def prestop_sleep(container: dict) -> float:
    hook = ((container.get("lifecycle") or {}).get("preStop")) or {}
    if "sleep" in hook:
        return float(hook["sleep"].get("seconds", 0))
    m = re.search(r"sleep\s+([0-9.]+)", " ".join(map(str, (hook.get("exec") or {}).get("command", []))))
    return float(m.group(1)) if m else 0.0


def words(c: dict) -> str:
    return " ".join(map(str, (c.get("command") or []) + (c.get("args") or [])))


def drain_need(c: dict) -> float:
    """The engine's SIGTERM drain in container ``c``: a preStop sleep, the delay and the timeout."""
    text = words(c)
    return (prestop_sleep(c) + flag(text, "--shutdown-delay", SHUTDOWN_DELAY_S)
            + flag(text, "--shutdown-timeout", SHUTDOWN_TIMEOUT_S))


def runs_preload(c: dict) -> bool:
    return "wcache preload" in words(c) or (c.get("command") == ["wcache"] and (c.get("args") or [""])[0] == "preload")


@pytest.mark.parametrize("path", MANIFESTS, ids=[p.name for p in MANIFESTS])
def test_the_grace_period_covers_the_daemons_stop_after_the_engines_drain(path):
    """The daemon stops after the engine: in the same script (the one-container pods) or as a native
    sidecar, which Kubernetes stops once the main containers have exited. The grace period then
    also holds the launcher's --weight-cache-stop-timeout, after which it kills a hung rank and
    removes its socket, before the kubelet kills the container."""
    checked = 0
    for spec in pod_specs(path):
        engines = [drain_need(c) + STOP_MARGIN_S for c in spec["containers"]
                   if "wcache serve" in words(c) or c.get("name") == "engine"]
        sidecars = [c for c in spec.get("initContainers") or [] if c.get("restartPolicy") == "Always"]
        for c in spec["containers"] + sidecars:
            if not runs_preload(c):
                continue
            need = flag(words(c), "--weight-cache-stop-timeout", STOP_TIMEOUT_S) + DAEMON_MARGIN_S
            if "wcache serve" in words(c) or c in sidecars:  # stopped after the engine
                need += max(engines, default=0.0)
            grace = spec.get("terminationGracePeriodSeconds", 30)  # Kubernetes' default
            assert grace >= need, f"{path.name}: terminationGracePeriodSeconds {grace} < {need} s"
            checked += 1
    if not checked:
        pytest.skip(f"{path.name} runs no wcache preload")


@pytest.mark.parametrize("path", MANIFESTS, ids=[p.name for p in MANIFESTS])
def test_the_grace_period_covers_the_engines_drain(path):
    checked = 0
    for spec in pod_specs(path):
        for c in spec["containers"]:
            text = " ".join(map(str, (c.get("command") or []) + (c.get("args") or [])))
            if "wcache serve" not in text and c.get("name") != "engine":  # an image whose entrypoint serves
                continue
            need = (prestop_sleep(c) + flag(text, "--shutdown-delay", SHUTDOWN_DELAY_S)
                    + flag(text, "--shutdown-timeout", SHUTDOWN_TIMEOUT_S) + STOP_MARGIN_S)
            grace = spec.get("terminationGracePeriodSeconds", 30)  # Kubernetes' default
            assert grace >= need, f"{path.name}: terminationGracePeriodSeconds {grace} < {need} s of drain"
            checked += 1
    if not checked:
        pytest.skip(f"{path.name} runs no wcache serve")
