"""Run every page of the guide, one test per page (its blocks in order), and check coverage.

`python -m tools.docs_runner run PAGE...` runs this module for chosen pages (WCACHE_DOCS_PAGES).
"""

import os
import shutil
from pathlib import Path

import pytest
from tools.docs_runner import coverage
from tools.docs_runner.page import run_page
from tools.docs_runner.parse import display, doc_pages, extract_blocks
from tools.docs_runner.substitutions import load_substitutions


def _pages() -> list[Path]:
    chosen = os.environ.get("WCACHE_DOCS_PAGES")
    if chosen:
        return [Path(p) for p in chosen.split(os.pathsep) if p]
    return doc_pages()


PAGES = _pages()
# On a CUDA host every page runs again as the reader types it there: substitutions off, GPU-only
# blocks included. A page's `--device cpu` lines stay on the CPU, as they would for that reader.
GPU_PAGES = PAGES


@pytest.mark.parametrize("page", PAGES, ids=[display(p) for p in PAGES])
def test_page(page: Path) -> None:
    coverage.SESSION.used = True
    run_page(page, recorder=coverage.SESSION)


_GPU_PARAMS = [pytest.param(p, id=display(p)) for p in GPU_PAGES]


@pytest.mark.gpu
@pytest.mark.parametrize("page", _GPU_PARAMS)
def test_page_on_gpu(page: Path) -> None:
    """On a CUDA host (`make test-gpu`): every page again, GPU-only blocks included, unsubstituted."""
    if not os.environ.get(coverage.GPU_ENV) or shutil.which("nvidia-smi") is None:
        pytest.skip(f"GPU-only blocks run on a CUDA host with {coverage.GPU_ENV}=1")
    coverage.SESSION.used = True
    run_page(page, recorder=coverage.SESSION, gpu=True)


def test_coverage() -> None:
    """Every block is run, validated, or marked with a reason; every marker is well formed."""
    coverage.SESSION.used = True
    blocks, errors = coverage.all_blocks()
    summary = coverage.format_summary(blocks, None, load_substitutions(), errors)
    print(summary)
    problems = [f"marker/fence error: {e}" for e in errors]
    problems += [
        f"unmarked block: {u} - run it, validate it, or mark it"
        ' (<!-- block: skip reason="..." --> / illustration / expect-output)'
        for u in coverage.coverage(blocks)["unmarked"]
    ]
    if problems:
        pytest.fail("\n".join(problems) + "\n\n" + summary, pytrace=False)
    assert blocks, "no fenced blocks found in docs/ at all"
