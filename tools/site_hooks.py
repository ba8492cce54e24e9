"""MkDocs hooks (mkdocs.yml ``hooks:``): build-time touches of the guide's HTML.

Expected output. A block the docs runner compares with a command's output is marked in the Markdown
with ``<!-- block: expect-output -->`` (tools/docs_runner/markers.py); the comment survives into the
HTML, right before the code block. This hook adds the class ``wc-output`` to that block, so the
stylesheet can set it apart from the commands and hide its copy button (docs/stylesheets/extra.css;
tests/browser checks both).
"""

from __future__ import annotations

import re

OUTPUT_CLASS = "wc-output"
_MARKED = re.compile(r'(<!-- block: expect-output -->\s*<div class=")((?:language-[\w-]+ )?highlight)(")')


def mark_output_blocks(html: str) -> str:
    return _MARKED.sub(lambda m: f"{m.group(1)}{m.group(2)} {OUTPUT_CLASS}{m.group(3)}", html)


def on_page_content(html: str, **kwargs) -> str:
    return mark_output_blocks(html)
