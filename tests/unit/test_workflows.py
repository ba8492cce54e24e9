"""The GitHub workflows the project ships (.github/workflows): valid against GitHub's workflow schema
(the copy vendored in check-jsonschema, read offline, by the validator the guide's YAML blocks use),
and doing what docs/gpu-ci.md says: `make test-gpu` on a self-hosted GPU runner with its log kept,
`make test` on an ordinary runner."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from tools.docs_runner.handlers.validate import is_github_workflow, validate_github_workflow

WORKFLOWS = Path(__file__).resolve().parents[2] / ".github" / "workflows"


def load(name: str) -> dict:
    doc = yaml.safe_load((WORKFLOWS / name).read_text())
    assert is_github_workflow(doc), name
    return doc


@pytest.mark.parametrize("name", ["ci.yml", "gpu.yml"])
def test_the_workflow_is_valid_against_githubs_schema(name):
    assert validate_github_workflow(load(name)) == []


def _steps(doc: dict) -> list[dict]:
    (job,) = doc["jobs"].values()
    return job["steps"]


def test_the_gpu_workflow_runs_make_test_gpu_on_a_gpu_runner_and_keeps_its_log():
    doc = load("gpu.yml")
    (job,) = doc["jobs"].values()
    assert job["runs-on"] == ["self-hosted", "linux", "gpu"]
    steps = _steps(doc)
    run = next(s for s in steps if "run" in s)
    assert run["run"].startswith("make test-gpu ") and run["shell"] == "bash"  # GitHub's bash: -o pipefail
    log = run["run"].rsplit("tee ", 1)[1]
    upload = next(s for s in steps if s.get("uses", "").startswith("actions/upload-artifact@"))
    assert upload["with"]["path"] == log and upload["if"] == "always()"


def test_the_ci_workflow_runs_make_test_on_an_ordinary_runner():
    doc = load("ci.yml")
    (job,) = doc["jobs"].values()
    assert job["runs-on"] == "ubuntu-latest"
    assert any(s.get("run", "").startswith("bash .ci/run") for s in _steps(doc))
    assert "make test\n" in (WORKFLOWS.parents[1] / ".ci" / "run").read_text()


def test_a_broken_workflow_is_refused():
    """The negative control: the schema is really applied (a job without runs-on, a misspelt key)."""
    doc = load("gpu.yml")
    (job,) = doc["jobs"].values()
    del job["runs-on"]
    job["step"] = job.pop("steps")
    errors = validate_github_workflow(doc)
    assert errors and all(e.startswith("github workflow: /jobs/test-gpu") for e in errors), errors
