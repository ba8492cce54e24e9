"""The ``<!-- block: ... -->`` comments that say what the runner does with the next fence.

The comment is invisible on the site; the parser hands its text over from an ``html_block`` token.
This module is the one place the vocabulary is defined (``MARKERS``, ``ATTRIBUTES``).
"""

from __future__ import annotations

import dataclasses
import re
import shlex

RUN_LANGS = {"python", "bash"}
VALIDATE_LANGS = {"yaml", "json"}
OUTPUT_LANGS = {"console", "text", "log"}
LANG_ALIASES = {"py": "python", "python3": "python", "sh": "bash", "shell": "bash", "yml": "yaml"}


class MarkerError(ValueError):
    """A marker, fence or snippet that the runner refuses (with page:line in the message)."""


@dataclasses.dataclass(frozen=True)
class MarkerSpec:
    doc: str
    langs: frozenset[str] | None = None  # None: any language
    needs_reason: bool = False
    alone: bool = False  # cannot be combined with other words


MARKERS: dict[str, MarkerSpec] = {
    "skip": MarkerSpec(
        "Not run or validated here; the reason says why and where it is (e.g. 'GPU-only: ...',"
        " 'multi-node: ...'). Reasons starting with 'GPU-only' run when WCACHE_RUN_GPU_BLOCKS=1.",
        needs_reason=True,
        alone=True,
    ),
    "illustration": MarkerSpec(
        "Shows a shape (a placeholder, an excerpt, markup about markup), never meant to run.",
        needs_reason=True,
        alone=True,
    ),
    "expect-output": MarkerSpec(
        "Each non-empty line must appear, in order, in the output of the previous bash block on"
        " the page or in the log files its background commands write ('...' matches any text).",
        langs=frozenset(OUTPUT_LANGS),
    ),
    "whole-output": MarkerSpec(
        "With expect-output: the block shows the previous bash block's whole output, no line left"
        " out (its printed lines, not its logs, are exactly as many as the block's non-empty lines;"
        " '...' still stands for a changing value within a line).",
        langs=frozenset(OUTPUT_LANGS),
    ),
    "expect-fail": MarkerSpec(
        "The block must fail: a bash block must exit non-zero, a YAML/JSON block must be rejected"
        " by its validator. Its output still feeds a following expect-output block; a YAML/JSON"
        " block needs one, which its rejection's text must match.",
        langs=frozenset({"bash", "yaml", "json"}),
    ),
    "loader-config": MarkerSpec(
        "A --model-loader-extra-config JSON object: validated by"
        " wcache.engine.loading.config.parse_loader_config (unknown keys and bad values are rejected).",
        langs=frozenset({"json"}),
    ),
}

ATTRIBUTES: dict[str, str] = {
    "reason": "Why a block is skipped or only an illustration (required by skip/illustration).",
    "timeout": "bash only: the block's wall-clock limit in seconds (default 300).",
}


@dataclasses.dataclass
class Marker:
    words: tuple[str, ...]
    attrs: dict[str, str]
    line: int  # 1-based line of the comment

    def has(self, word: str) -> bool:
        return word in self.words

    @property
    def reason(self) -> str:
        return self.attrs.get("reason", "")

    def __str__(self) -> str:
        parts = list(self.words) + [f'{k}="{v}"' for k, v in self.attrs.items()]
        return "<!-- block: " + " ".join(parts) + " -->"


MARKER_RE = re.compile(r"^\s*<!--\s*block:(?P<body>.*?)-->\s*$", re.DOTALL)


def is_marker(html: str) -> bool:
    """Whether an HTML block is a block marker (other HTML comments are left alone)."""
    return re.match(r"\s*<!--\s*block:", html) is not None


def parse_marker(text: str, where: str, line: int) -> Marker:
    """Parse one ``<!-- block: ... -->`` comment (possibly spanning lines, or several in a row)."""
    bodies = []
    for part in re.findall(r"<!--.*?-->", text, re.DOTALL) or [text]:
        m = MARKER_RE.match(part)
        if not m:
            raise MarkerError(f"{where}: malformed block marker {part.strip()!r}")
        bodies.append(m.group("body"))
    try:
        tokens = shlex.split(" ".join(bodies))
    except ValueError as e:
        raise MarkerError(f"{where}: cannot parse block marker {text.strip()!r}: {e}") from None
    words: list[str] = []
    attrs: dict[str, str] = {}
    for tok in tokens:
        if "=" in tok:
            key, _, value = tok.partition("=")
            if key not in ATTRIBUTES:
                raise MarkerError(f"{where}: unknown marker attribute {key!r}; known: {', '.join(ATTRIBUTES)}")
            attrs[key] = value.strip()
        else:
            if tok not in MARKERS:
                raise MarkerError(f"{where}: unknown marker word {tok!r}; known: {', '.join(MARKERS)}")
            words.append(tok)
    if not words and not attrs:
        raise MarkerError(f"{where}: block marker names no marker ({', '.join(MARKERS)})")
    marker = Marker(tuple(words), attrs, line)
    for w in words:
        spec = MARKERS[w]
        if spec.needs_reason and not marker.reason:
            raise MarkerError(f'{where}: "{w}" marker needs a non-empty reason="..."')
        if spec.alone and len(words) > 1:
            raise MarkerError(f'{where}: "{w}" cannot be combined with {words}')
    if "reason" in attrs and not any(MARKERS[w].needs_reason for w in words):
        raise MarkerError(f"{where}: reason= is only for skip/illustration markers")
    if "timeout" in attrs:
        try:
            if float(attrs["timeout"]) <= 0:
                raise ValueError
        except ValueError:
            raise MarkerError(f"{where}: timeout must be a positive number of seconds") from None
    return marker


def check_applies(marker: Marker, lang: str, where: str) -> None:
    """A marker word or attribute on a block of a language it does not apply to is an error."""
    for w in marker.words:
        spec = MARKERS[w]
        if spec.langs is not None and lang not in spec.langs:
            raise MarkerError(
                f"{where}: marker {w!r} does not apply to a {lang or 'untagged'} block"
                f" (only {', '.join(sorted(spec.langs))})"
            )
    if "timeout" in marker.attrs and lang != "bash":
        raise MarkerError(f"{where}: timeout= only applies to bash blocks")


def norm_lang(info: str) -> str:
    """The block's language from its fence info string (``bash``, ``{.python title="x"}``)."""
    info = info.strip()
    if info.startswith("{"):
        info = info.strip("{}").strip()
    first = info.split()[0] if info.split() else ""
    first = first.lstrip(".").lower()
    return LANG_ALIASES.get(first, first)
