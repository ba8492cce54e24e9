"""Run every page of the guide (one test per page, its blocks in order) and check coverage.

`python tools/blocks.py run PAGE` runs this module for chosen pages (WCACHE_DOCS_PAGES).
"""

import os
import shutil
from pathlib import Path

import blocks
import pytest


def _pages() -> list[Path]:
    chosen = os.environ.get("WCACHE_DOCS_PAGES")
    if chosen:
        return [Path(p) for p in chosen.split(os.pathsep) if p]
    return blocks.doc_pages()


PAGES = _pages()
GPU_PAGES = [p for p in PAGES if blocks.has_gpu_only_blocks(p)]


def _id(page: Path) -> str:
    return blocks._display(page, blocks.ROOT)


@pytest.mark.parametrize("page", PAGES, ids=[_id(p) for p in PAGES])
def test_page(page: Path, request: pytest.FixtureRequest) -> None:
    blocks.SESSION.used = True
    blocks.run_page(page, request=request, recorder=blocks.SESSION)


_GPU_PARAMS = [pytest.param(p, id=_id(p)) for p in GPU_PAGES] or [
    pytest.param(None, id="none", marks=pytest.mark.skip(reason="no page has GPU-only blocks"))
]


@pytest.mark.gpu
@pytest.mark.parametrize("page", _GPU_PARAMS)
def test_page_on_gpu(page: Path, request: pytest.FixtureRequest) -> None:
    """On a CUDA host (`make test-gpu`): the page again, GPU-only blocks included, unsubstituted."""
    if not os.environ.get(blocks.GPU_ENV) or shutil.which("nvidia-smi") is None:
        pytest.skip(f"GPU-only blocks run on a CUDA host with {blocks.GPU_ENV}=1")
    blocks.SESSION.used = True
    blocks.run_page(page, request=request, recorder=blocks.SESSION, gpu=True)


def test_coverage() -> None:
    """Every block is run, validated, or marked with a reason; every marker is well formed."""
    blocks.SESSION.used = True
    all_blocks, errors = blocks.all_blocks()
    summary = blocks.format_summary(all_blocks, None, blocks.load_substitutions(), errors)
    print(summary)
    unmarked = blocks.coverage(all_blocks)["unmarked"]
    problems = [f"marker/fence error: {e}" for e in errors]
    problems += [
        f"unmarked block: {u} - run it, validate it, or mark it"
        ' (<!-- block: skip reason="..." --> / illustration / expect-output)'
        for u in unmarked
    ]
    if problems:
        pytest.fail("\n".join(problems) + "\n\n" + summary, pytrace=False)
    assert all_blocks, "no fenced blocks found in docs/ at all"
