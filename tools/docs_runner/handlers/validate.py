"""YAML and JSON blocks: parsed, and validated by what would consume them. A Compose file against the
compose-spec schema vendored in check-jsonschema, a GitHub Actions workflow against the
github-workflows schema vendored there too; a Kubernetes object (or a bare pod spec, wrapped in
a Pod) with kubernetes-validate in strict mode; a loader config by wcache's own parser."""

from __future__ import annotations

import importlib
import json
from functools import lru_cache

#: Kubernetes version whose strict schemas (shipped with kubernetes-validate) the guide targets.
K8S_VERSION = "1.30.0"


def _library(module: str, package: str):
    """Import a validator, or say in one line which dev dependency is missing (a GPU host's own
    Python may lack them: `make dev` installs them)."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise RuntimeError(f"validating this block needs {package} (the dev extra: make dev, or "
                           f"pip install -e '.[dev]')") from None


@lru_cache(maxsize=None)
def vendored_schema(name: str) -> dict:
    """A JSON schema that check-jsonschema ships (``compose-spec``, ``github-workflows``): offline."""
    _library("check_jsonschema", "check-jsonschema")
    from importlib import resources

    ref = resources.files("check_jsonschema.builtin_schemas.vendor") / f"{name}.json"
    return json.loads(ref.read_text(encoding="utf-8"))


def _schema_errors(name: str, doc: dict, label: str) -> list[str]:
    jsonschema = _library("jsonschema", "jsonschema")

    schema = vendored_schema(name)
    cls = jsonschema.validators.validator_for(schema)
    errors = sorted(cls(schema).iter_errors(doc), key=lambda e: list(map(str, e.absolute_path)))
    return [f"{label}: /{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in errors]


def validate_compose(doc: dict) -> list[str]:
    return _schema_errors("compose-spec", doc, "compose")


def is_github_workflow(doc) -> bool:
    # YAML 1.1 (PyYAML) reads the key `on` as True; GitHub reads it as the string "on".
    return isinstance(doc, dict) and "jobs" in doc and ("on" in doc or True in doc)


def validate_github_workflow(doc: dict) -> list[str]:
    doc = {("on" if k is True else k): v for k, v in doc.items()}
    return _schema_errors("github-workflows", doc, "github workflow")


def validate_k8s(doc: dict) -> list[str]:
    kubernetes_validate = _library("kubernetes_validate", "kubernetes-validate")

    try:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    except kubernetes_validate.ValidationError as e:
        path = "/".join(map(str, e.absolute_path))
        return [f"kubernetes {K8S_VERSION} (strict) {doc.get('kind')}: /{path}: {e.message}"]
    except kubernetes_validate.SchemaNotFoundError as e:
        return [f"kubernetes: {e.message}"]
    return []


def validate_yaml(text: str) -> tuple[list[str], str]:
    """(errors, what was checked)."""
    import yaml

    try:
        docs = [d for d in yaml.safe_load_all(text) if d is not None]
    except yaml.YAMLError as e:
        return [f"YAML does not parse: {e}"], "yaml"
    errors: list[str] = []
    kinds: list[str] = []
    for d in docs:
        if is_github_workflow(d):
            kinds.append("github workflow")
            errors += validate_github_workflow(d)
        elif isinstance(d, dict) and "services" in d:
            kinds.append("compose")
            errors += validate_compose(d)
        elif isinstance(d, dict) and "apiVersion" in d and "kind" in d:
            kinds.append(f"k8s {d['kind']}")
            errors += validate_k8s(d)
        elif isinstance(d, dict) and "containers" in d and "kind" not in d:
            kinds.append("k8s pod spec")
            pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "docs-example"}, "spec": d}
            errors += validate_k8s(pod)
        else:
            kinds.append("yaml (parsed)")
    return errors, ", ".join(kinds) or "yaml (empty)"


def validate_json(text: str, loader_config: bool) -> tuple[list[str], str]:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        return [f"JSON does not parse: {e}"], "json"
    if not loader_config:
        return [], "json (parsed)"
    from wcache.engine.loading.config import parse_loader_config
    from wcache.errors import LoaderConfigError

    try:
        parse_loader_config(obj)
    except LoaderConfigError as e:
        return [f"LoaderConfigError: {e}"], "loader-config"
    return [], "loader-config"
