"""`make docs` installs only what the site needs: pyproject's docs extra, in a venv of its own."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))

from extra_requirements import requirements  # noqa: E402


def names(reqs: list[str]) -> set[str]:
    return {re.split(r"[<>=!\[; ]", r, maxsplit=1)[0] for r in reqs}


def test_the_docs_extra_is_the_site_s_packages_and_nothing_else():
    mkdocs_yml = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    assert "name: material" in mkdocs_yml and "pymdownx." in mkdocs_yml
    assert names(requirements("docs")) == {"mkdocs", "mkdocs-material", "pymdown-extensions"}
    assert "wcache[docs]" in requirements("dev")  # the test suite builds the site too


def test_make_docs_installs_the_docs_extra_alone():
    for target in ("docs", "docs-serve"):
        plan = subprocess.run(["make", "-n", "-B", target], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout
        assert "extra_requirements.py docs | xargs .work/docs-venv/bin/python -m pip install" in plan, plan
        assert "[dev]" not in plan and "torch" not in plan and "transformers" not in plan, plan
    assert "127.0.0.1:8765" in subprocess.run(["make", "-n", "-B", "docs-serve"], cwd=ROOT, capture_output=True,
                                              text=True, check=True).stdout
