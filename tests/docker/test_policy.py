"""checkov's Kubernetes and Dockerfile policies over examples/: no finding, and every skip reviewed.

checkov runs from its own virtualenv, .work/checkov-venv (the Makefile's `checkov` target, a
prerequisite of `make test`): its pinned dependencies (packaging 23, networkx 2.6) would downgrade
the project's venv, whose torch needs a newer networkx. It runs offline (--skip-download, no
guideline mapping; as root also in a network namespace of its own, so it cannot reach anything).

A finding fails. A finding may be skipped only in the file, with the check's id and a reason
(`checkov.io/skipN: "CKV_K8S_XX=reason"` on the object's annotations, `#checkov:skip=ID:reason` in
the Dockerfile), and only for the ids that SKIPPED lists: a new skip is a change a reviewer sees here.
"""

from __future__ import annotations

import json
import os
import re
import subprocess

import pytest
import yaml
from dockerlib import ROOT

CHECKOV = ROOT / ".work" / "checkov-venv" / "bin" / "checkov"
EXAMPLES = ROOT / "examples"

#: Every check skipped somewhere in examples/, and why it is acceptable (the files give each reason).
SKIPPED = {
    "CKV_K8S_43": "image digest: the image is the reader's own build; pin its digest once pushed",
    "CKV_K8S_15": "imagePullPolicy Always: a restart must not depend on the registry; versioned tags",
    "CKV_K8S_21": "default namespace: the files leave the namespace to kubectl apply -n",
    "CKV_K8S_35": "secret as env: wcache reads the seed token and the API key (VLLM_API_KEY) from variables or flags",
    "CKV2_K8S_6": "NetworkPolicy: the Deployment file has one; the single pods leave it to the cluster",
    "CKV_DOCKER_7": "base tag: FROM takes an ARG whose default is a release tag checkov cannot read",
}


@pytest.fixture(scope="module")
def report() -> dict[str, dict]:
    if not CHECKOV.exists():
        reason = f"checkov is not installed at {CHECKOV.relative_to(ROOT)} (`make checkov` installs it)"
        if os.environ.get("CI") == "true":
            pytest.fail(f"{reason}; CI=true must run it", pytrace=False)
        pytest.skip(reason)
    argv = [str(CHECKOV), "-d", str(EXAMPLES), "--framework", "kubernetes", "dockerfile", "--skip-download",
            "-o", "json"]
    if os.geteuid() == 0:
        argv = ["unshare", "--net", *argv]  # no network at all: checkov asks a vendor API otherwise
    env = {**os.environ, "BC_SKIP_MAPPING": "TRUE", "CHECKOV_RUN_SCA_PACKAGE_SCAN_V2": "false"}
    r = subprocess.run(argv, capture_output=True, text=True, timeout=300, env=env)
    assert r.stdout.strip(), f"checkov printed no report (exit {r.returncode}):\n{r.stderr[-4000:]}"
    data = json.loads(r.stdout)
    return {d["check_type"]: d for d in (data if isinstance(data, list) else [data])}


def kubernetes_objects() -> list[tuple[str, dict]]:
    return [(p.name, d) for p in sorted(EXAMPLES.glob("k8s-*.yaml")) for d in yaml.safe_load_all(p.read_text()) if d]


def test_checkov_scanned_every_example(report):
    # A file checkov cannot parse is left out without a finding (a colon in an annotation did it
    # once): count the objects it saw against the files.
    assert set(report) == {"kubernetes", "dockerfile"}, set(report)
    k8s, dockerfile = report["kubernetes"]["summary"], report["dockerfile"]["summary"]
    assert k8s["parsing_errors"] == 0 and dockerfile["parsing_errors"] == 0
    checked = {c["resource"] for c in (report["kubernetes"]["results"]["passed_checks"]
                                       + report["kubernetes"]["results"]["skipped_checks"])}
    for name, doc in kubernetes_objects():
        if doc["kind"] in ("Pod", "Deployment", "Job", "Service"):  # the kinds checkov has checks for
            assert f"{doc['kind']}.default.{doc['metadata']['name']}" in checked, f"{name}: checkov did not check it"
    assert dockerfile["resource_count"] == 1
    assert k8s["passed"] > 300 and dockerfile["passed"] > 100  # the checks ran, not just the parser


def test_no_finding(report):
    failed = [(c["check_id"], c["resource"], c["file_path"], c["check_name"])
              for d in report.values() for c in d["results"]["failed_checks"]]
    assert failed == [], "checkov findings: fix them, or skip one in its file with a reason:\n" + "\n".join(map(str, failed))


def test_every_skip_is_listed_here_and_gives_its_reason_in_the_file(report):
    skipped = {c["check_id"] for d in report.values() for c in d["results"]["skipped_checks"]}
    assert skipped <= set(SKIPPED), f"new skips to review: {skipped - set(SKIPPED)}"
    reasons = {}
    for name, doc in kubernetes_objects():
        for key, value in (doc["metadata"].get("annotations") or {}).items():
            if key.startswith("checkov.io/skip"):
                check, _, reason = value.partition("=")
                reasons.setdefault(check, []).append((name, reason))
    for line in (EXAMPLES / "Dockerfile").read_text().splitlines():
        m = re.match(r"#checkov:skip=(\w+):(.*)", line)
        if m:
            reasons.setdefault(m.group(1), []).append(("Dockerfile", m.group(2)))
    assert set(reasons) == skipped, (set(reasons), skipped)
    for check, where in reasons.items():
        for name, reason in where:
            assert len(reason.split()) >= 8, f"{name}: {check} is skipped without a reason a reviewer can judge: {reason!r}"
