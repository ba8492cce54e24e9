"""``python -m tools.docs_runner list [PAGE...]``: every block with page:line, language and what CI
does with it, then the coverage counts. ``python -m tools.docs_runner run PAGE...``: run those
pages' blocks through pytest, as CI does (tests/docs/test_blocks.py)."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

from . import ROOT
from .coverage import SKIPPED, UNMARKED, coverage, disposition, format_summary
from .markers import MarkerError
from .parse import Block, doc_pages, extract_blocks
from .substitutions import load_substitutions


def cmd_list(pages: list[str]) -> int:
    paths = [Path(p) for p in pages] if pages else doc_pages()
    subs = load_substitutions()
    blocks: list[Block] = []
    errors: list[str] = []
    for p in paths:
        try:
            page_blocks = extract_blocks(p)
        except MarkerError as e:
            errors.append(str(e))
            continue
        blocks += page_blocks
        for b in page_blocks:
            kind, detail = disposition(b, None, subs)
            if kind == SKIPPED:
                shown = f"skipped ({detail})"
            elif kind == UNMARKED:
                shown = f"UNMARKED ({detail})"
            else:
                extras = list(b.marker.words) if b.marker else []
                if b.includes:
                    extras.append("snippet " + ", ".join(b.includes))
                shown = kind + (f" ({'; '.join(extras)})" if extras else "")
            print(f"{b.where:<32} {b.lang or '-':<8} {shown}")
    print()
    print(format_summary(blocks, None, subs, errors))
    return 1 if errors or coverage(blocks)["unmarked"] else 0


def cmd_run(pages: list[str]) -> int:
    env = dict(os.environ, WCACHE_DOCS_PAGES=os.pathsep.join(str(Path(p).resolve()) for p in pages))
    test = ROOT / "tests" / "docs" / "test_blocks.py"
    return subprocess.call([sys.executable, "-m", "pytest", str(test), "-k", "test_page", "-q",
                            "-p", "no:cacheprovider"], env=env, cwd=ROOT)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.docs_runner",
                                     description="Run or list the guide's fenced blocks.")
    sub = parser.add_subparsers(dest="cmd", required=True)
    sub.add_parser("list", help="every block with page:line, language, disposition").add_argument("pages", nargs="*")
    sub.add_parser("run", help="run the blocks of the given pages (through pytest)").add_argument("pages", nargs="+")
    args = parser.parse_args(argv)
    return cmd_list(args.pages) if args.cmd == "list" else cmd_run(args.pages)


if __name__ == "__main__":
    sys.exit(main())
