"""What happens to each block (run as written, run under a substitution, validated, skipped with a
reason, unmarked), and the summary line: "docs blocks: N on M page(s): run X as written and S
under a substitution, validated Y, skipped Z, unmarked 0".

A bash block that a CPU substitution rewrites is not counted as run: CI runs another command than
the reader's (``--device cuda`` becomes ``--device cpu``, so a ``vmm_fd`` block runs the memfd
transport), and the summary lists each such block with the rewrites it gets."""

from __future__ import annotations

import collections
import dataclasses
import os
from collections.abc import Iterable
from typing import Any

from .markers import MarkerError, RUN_LANGS, VALIDATE_LANGS
from .parse import Block, doc_pages, extract_blocks
from .substitutions import Substitution

RUN, VALIDATED, SKIPPED, UNMARKED, FAILED = "run", "validated", "skipped", "unmarked", "failed"
SUBSTITUTED = "run under a substitution"
#: Set to 1 on a GPU machine: substitutions are off and "GPU-only" skips are run.
GPU_ENV = "WCACHE_RUN_GPU_BLOCKS"


def gpu_mode() -> bool:
    return os.environ.get(GPU_ENV, "") not in ("", "0")


def rewrites(block: Block, subs: list[Substitution] | None, gpu: bool) -> list[str]:
    """The substitutions CI makes in a bash block (none on a GPU host), as 'pattern -> replacement'."""
    if gpu or block.lang != "bash" or not subs:
        return []
    return [f"{s.pattern_text!r} -> {s.replace!r}" for s in subs if s.pattern.search(block.source)]


def disposition(block: Block, gpu: bool | None = None,
                subs: list[Substitution] | None = None) -> tuple[str, str]:
    """(run | run under a substitution | validated | skipped | unmarked, detail) for one block,
    without running it. ``subs``: the substitutions in force (none: a block counts as run)."""
    gpu = gpu_mode() if gpu is None else gpu
    mk = block.marker
    if mk and mk.has("skip") and not (gpu and mk.reason.lower().startswith("gpu-only")):
        return SKIPPED, mk.reason
    if mk and mk.has("illustration"):
        return SKIPPED, "illustration: " + mk.reason
    if block.lang in RUN_LANGS:
        changed = rewrites(block, subs, gpu)
        return (SUBSTITUTED, f"{block.lang}, " + ", ".join(changed)) if changed else (RUN, block.lang)
    if block.lang in VALIDATE_LANGS:
        return VALIDATED, block.lang
    if mk and mk.has("expect-output"):
        return VALIDATED, "expect-output"
    return UNMARKED, f"{block.lang or 'untagged'} block without a marker"


def is_gpu_only(block: Block) -> bool:
    return bool(block.marker and block.marker.has("skip") and block.marker.reason.lower().startswith("gpu-only"))


@dataclasses.dataclass
class Result:
    where: str
    lang: str
    kind: str  # run / validated / skipped / unmarked / failed
    detail: str


class Recorder:
    """What actually happened to each block during a test session, and how often each
    substitution was applied."""

    def __init__(self) -> None:
        self.results: list[Result] = []
        self.substitutions_applied: collections.Counter[int] = collections.Counter()
        self.used = False  # set by the docs tests, so the session summary knows to print

    def add(self, block: Block, kind: str, detail: str = "") -> None:
        self.results.append(Result(block.where, block.lang, kind, detail))


#: The session-wide recorder of tests/docs (the runner's own tests use their own).
SESSION = Recorder()


def coverage(blocks: Iterable[Block], gpu: bool | None = None,
             subs: list[Substitution] | None = None) -> dict[str, Any]:
    counts: collections.Counter[str] = collections.Counter()
    reasons: collections.Counter[str] = collections.Counter()
    unmarked: list[str] = []
    substituted: list[str] = []
    for b in blocks:
        kind, detail = disposition(b, gpu, subs)
        counts[kind] += 1
        if kind == SKIPPED:
            reasons[detail] += 1
        elif kind == UNMARKED:
            unmarked.append(f"{b.where} ({detail})")
        elif kind == SUBSTITUTED:
            substituted.append(f"{b.where} ({detail.split(', ', 1)[1]})")
    return {"counts": counts, "skipped_reasons": reasons, "unmarked": unmarked, "substituted": substituted}


def all_blocks() -> tuple[list[Block], list[str]]:
    """All blocks of the guide, and the extraction errors (one per broken page)."""
    blocks: list[Block] = []
    errors: list[str] = []
    for page in doc_pages():
        try:
            blocks.extend(extract_blocks(page))
        except MarkerError as e:
            errors.append(str(e))
    return blocks, errors


def format_summary(
    blocks: list[Block],
    recorder: Recorder | None = None,
    substitutions: list[Substitution] | None = None,
    errors: list[str] | None = None,
) -> str:
    cov = coverage(blocks, None, substitutions)
    c = cov["counts"]
    pages = len({b.rel for b in blocks})
    out = [
        f"docs blocks: {len(blocks)} on {pages} page(s): run {c[RUN]} as written and {c[SUBSTITUTED]} under a"
        f" substitution, validated {c[VALIDATED]}, skipped {c[SKIPPED]}, unmarked {c[UNMARKED]}"
        + ("  [GPU mode]" if gpu_mode() else "")
    ]
    for where in cov["substituted"]:
        out.append(f"  under a substitution: {where}")
    for reason, n in sorted(cov["skipped_reasons"].items()):
        out.append(f"  skipped x{n}: {reason}")
    for u in cov["unmarked"]:
        out.append(f"  UNMARKED: {u}")
    for e in errors or []:
        out.append(f"  ERROR: {e}")
    if recorder is not None and recorder.results:
        done = collections.Counter(r.kind for r in recorder.results)
        out.append(
            "  executed this session: "
            + ", ".join(f"{k} {done[k]}" for k in (RUN, SUBSTITUTED, VALIDATED, SKIPPED, FAILED) if done[k])
        )
    if substitutions:
        out.append(
            "  substitutions (tools/substitutions.yaml)" + (" - off in GPU mode" if gpu_mode() else "") + ":"
        )
        for n, s in enumerate(substitutions):
            applied = recorder.substitutions_applied[n] if recorder else 0
            out.append(f"    {s.pattern_text!r} -> {s.replace!r} (applied {applied}x): {s.reason}")
    return "\n".join(out)
