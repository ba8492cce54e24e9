"""The Kubernetes manifests in examples/ give a pod time for the engine's whole SIGTERM drain
(engine/drain.py, docs/lifecycle.md#stopping-the-engine): ``terminationGracePeriodSeconds`` covers
a preStop hook's sleep, ``--shutdown-delay``, ``--shutdown-timeout`` (the manifest's own values, else
the flags' defaults) and a margin for the engine's own stop. Kubernetes sends SIGKILL at the grace
period's end, so a shorter one would cut the drain."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from wcache.engine.drain import SHUTDOWN_DELAY_S, SHUTDOWN_TIMEOUT_S

ROOT = Path(__file__).resolve().parents[2]
MANIFESTS = sorted((ROOT / "examples").glob("k8s-*.yaml"))
STOP_MARGIN_S = 10  # the engine's own stop after the drain (the respawn supervisor's STOP_GRACE_S)


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
