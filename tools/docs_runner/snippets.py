"""``--8<-- "path"`` lines inside a fence, resolved as pymdownx.snippets does (``base_path: ["."]``),
so the file a reader sees on the site is the file that is validated or run."""

from __future__ import annotations

import re
from pathlib import Path

from .markers import MarkerError

_SNIPPET = re.compile(r"^\s*-{1,}8<-{1,}\s+(?P<q>['\"])(?P<spec>.+?)(?P=q)\s*$")


def resolve_snippets(body: str, root: Path, where: str) -> tuple[str, tuple[str, ...]]:
    """``body`` with each ``--8<-- "path"`` (or ``"path:START:END"``) line replaced by the file's
    lines, and the paths it included."""
    out: list[str] = []
    included: list[str] = []
    for line in body.splitlines(keepends=True):
        m = _SNIPPET.match(line)
        if not m:
            out.append(line)
            continue
        spec = m.group("spec")
        path, start, end = spec, None, None
        parts = spec.rsplit(":", 2)
        if len(parts) == 3 and all(p.isdigit() or p == "" for p in parts[1:]):
            path = parts[0]
            start = int(parts[1]) if parts[1] else None
            end = int(parts[2]) if parts[2] else None
        file = (root / path).resolve()
        if not file.is_file():
            raise MarkerError(f"{where}: snippet {spec!r} not found (looked for {file})")
        lines = file.read_text(encoding="utf-8").splitlines(keepends=True)
        if start is not None or end is not None:
            lines = lines[(start or 1) - 1 : end]
        text = "".join(lines)
        if text and not text.endswith("\n"):
            text += "\n"
        out.append(text)
        included.append(path)
    return "".join(out), tuple(included)
