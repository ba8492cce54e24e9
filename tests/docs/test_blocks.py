"""Run every page of the guide (one test per page, its blocks in order) and check coverage.

`python tools/blocks.py run PAGE` runs this module for chosen pages (WCACHE_DOCS_PAGES).
"""

import os
from pathlib import Path

import blocks
import pytest


def _pages() -> list[Path]:
    chosen = os.environ.get("WCACHE_DOCS_PAGES")
    if chosen:
        return [Path(p) for p in chosen.split(os.pathsep) if p]
    return blocks.doc_pages()


PAGES = _pages()


@pytest.mark.parametrize("page", PAGES, ids=[blocks._display(p, blocks.ROOT) for p in PAGES])
def test_page(page: Path, request: pytest.FixtureRequest) -> None:
    blocks.SESSION.used = True
    blocks.run_page(page, request=request, recorder=blocks.SESSION)


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
