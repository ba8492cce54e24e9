"""The guide's block runner: every fenced block of docs/**/*.md is run, validated, or marked.

One module per concern: ``parse`` (Markdown tokens -> blocks), ``markers`` (the ``<!-- block: -->``
comments), ``snippets`` (``--8<--`` includes), ``substitutions`` (the declared CPU rewrites),
``shell`` (bash logical lines), ``coverage`` (dispositions and the summary), ``processes`` (what a
page leaves running), ``page`` (one page's blocks in order) and ``handlers`` (one per language).
docs/contributing.md explains it to writers; tests/docs/test_blocks.py runs it, one test per page.
"""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
