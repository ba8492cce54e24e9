"""The site builds with `mkdocs build --strict` and without a single warning."""

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ANSI = re.compile(r"\x1b\[[0-9;]*m")


def test_mkdocs_build_strict(tmp_path: Path) -> None:
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "mkdocs",
            "build",
            "--strict",
            "-f",
            "mkdocs.yml",
            "-d",
            str(tmp_path / "site"),
        ],
        cwd=ROOT,  # pymdownx.snippets resolves base_path "." against the working directory
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    output = ANSI.sub("", proc.stdout + proc.stderr)
    warnings = [line for line in output.splitlines() if re.match(r"\s*(WARNING|ERROR)\b", line)]
    assert proc.returncode == 0, output
    assert not warnings, "\n".join(warnings)
    assert (tmp_path / "site" / "index.html").is_file()


def test_site_opens_from_disk_and_shows_table_scrollbars(tmp_path: Path) -> None:
    """Opened as file://.../site/index.html, a link to foo/ shows a directory listing: every link to a
    page of the guide must name its .html file (use_directory_urls: false). And a wide table's scroll
    box must draw a visible scrollbar: the built CSS keeps the rules of docs/stylesheets/extra.css."""
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "mkdocs", "build", "-q", "-f", "mkdocs.yml", "-d", str(site)], cwd=ROOT,
                   env=dict(os.environ, NO_MKDOCS_2_WARNING="1"), check=True, capture_output=True, timeout=120)
    pages = {p.stem for p in (ROOT / "docs").glob("*.md")}
    for html in (site / "index.html", site / "benchmarks.html"):
        hrefs = re.findall(r'href="([^"#?]+)', html.read_text(encoding="utf-8"))
        to_pages = [h for h in hrefs if not re.match(r"[a-z]+:", h) and h.rstrip("/").split("/")[-1].removesuffix(".html") in pages]
        assert to_pages, f"{html.name}: no link to a page found"
        directories = [h for h in to_pages if h.endswith("/")]
        assert not directories, f"{html.name}: links that open a directory listing from disk: {directories}"
    css = (site / "stylesheets" / "extra.css").read_text(encoding="utf-8")
    for selector in (".md-typeset__scrollwrap::-webkit-scrollbar", ".md-typeset .wc-scroll::-webkit-scrollbar-thumb"):
        assert selector in css, f"the site's CSS lost the visible table scrollbar rule {selector}"
    assert re.search(r"\.md-typeset__scrollwrap,\s*\.md-typeset \.wc-scroll \{\s*scrollbar-width: auto", css)
