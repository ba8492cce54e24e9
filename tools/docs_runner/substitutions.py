"""The declared CPU rewrites of tools/substitutions.yaml (``--device cuda`` -> ``--device cpu``...).

They are the only text CI changes in a bash block; every one has a reason, is counted, and is
printed in the test summary. On a GPU host (``WCACHE_RUN_GPU_BLOCKS=1``) none is applied.
"""

from __future__ import annotations

import collections
import dataclasses
import re
from pathlib import Path

from . import ROOT

SUBSTITUTIONS_FILE = ROOT / "tools" / "substitutions.yaml"


@dataclasses.dataclass
class Substitution:
    pattern: re.Pattern[str]
    pattern_text: str
    replace: str
    reason: str


def load_substitutions(path: Path = SUBSTITUTIONS_FILE) -> list[Substitution]:
    import yaml

    data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    subs = []
    for n, entry in enumerate(data.get("substitutions", [])):
        if not isinstance(entry, dict) or not entry.get("reason"):
            raise ValueError(f"{path}: substitution #{n + 1} needs a reason")
        if ("literal" in entry) == ("regex" in entry):
            raise ValueError(f"{path}: substitution #{n + 1} needs exactly one of literal/regex")
        if "literal" in entry:
            text = str(entry["literal"])
            pattern = re.compile(re.escape(text))
            repl = str(entry.get("replace", "")).replace("\\", "\\\\")
        else:
            text = str(entry["regex"])
            pattern = re.compile(text)
            repl = str(entry.get("replace", ""))
        subs.append(Substitution(pattern, text, repl, " ".join(str(entry["reason"]).split())))
    return subs


def apply_substitutions(
    script: str, subs: list[Substitution], applied: collections.Counter[int] | None = None
) -> str:
    """``script`` with every substitution made; ``applied`` counts them by index."""
    for n, s in enumerate(subs):
        script, count = s.pattern.subn(s.replace, script)
        if applied is not None and count:
            applied[n] += count
    return script
