"""What a page left behind: the files its blocks made and did not remove.

A reader who pastes a page's blocks in order into one shell, in their checkout, should find the
checkout and ``/tmp`` as they were. The runner checks the same three places after a page's last
block (and after its processes are stopped):

* the page's working directory (the reader's checkout): empty again;
* the page's ``TMPDIR`` (where ``mktemp -d`` and wcache's default socket directory go): empty
  again, but for wcache's socket directory holding only daemons' ``<socket>.lock`` files. Those
  stay by design: a daemon that removed its lock file while a standby waits on it would let a
  third daemon lock a new file, and two daemons would own one device (docs/quickstart.md says
  so). And but for torch's own compile cache, ``torchinductor_<user>``, which torch makes there
  and keeps for every later run, as it does for the reader;
* ``/tmp`` itself: no entry that was not there before the page and whose name the page's text
  gives (``/tmp/tiny``, or a ``mktemp`` template such as ``/tmp/wcache-serve.XXXXXX``). Other
  processes add their own entries meanwhile; those are not the page's.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

TMP = Path("/tmp")


def tmp_entries() -> set[str]:
    try:
        return set(os.listdir(TMP))
    except OSError:
        return set()


def _listing(directory: Path, limit: int = 12) -> list[str]:
    out = []
    for path in sorted(directory.rglob("*")):
        if path.is_dir() and any(path.iterdir()):
            continue  # its files are listed
        out.append(str(path.relative_to(directory)) + ("/" if path.is_dir() else ""))
    return out[:limit] + ([f"... {len(out) - limit} more"] if len(out) > limit else [])


def _kept_by_design(path: Path) -> bool:
    """wcache's socket directory holding only lock files, or torch's compile cache (see above)."""
    if path.is_dir() and path.name.startswith("torchinductor_"):
        return True
    return path.is_dir() and path.name == f"wcache_{os.getuid()}" and all(
        p.is_file() and p.name.endswith(".lock") for p in path.iterdir())


_TMP_NAME = re.compile(r"/tmp/([\w.-]+)")


def _named_in(text: str):
    """A predicate: whether an entry of /tmp is one the text names (mktemp's X's match any run)."""
    patterns = [re.compile(re.sub(r"X{3,}", lambda m: f"[A-Za-z0-9]{{{len(m.group())}}}", re.escape(name)))
                for name in set(_TMP_NAME.findall(text))]
    return lambda entry: any(p.fullmatch(entry) for p in patterns)


def find(cwd: Path, tmpdir: Path, tmp_before: set[str], page_text: str) -> list[str]:
    """One line per place that is not as it was, naming what is left there."""
    problems = []
    left = _listing(cwd) if cwd.is_dir() else []
    if left:
        problems.append(f"left in the working directory (the reader's checkout): {', '.join(left)}")
    left = [p for p in sorted(tmpdir.iterdir()) if not _kept_by_design(p)] if tmpdir.is_dir() else []
    if left:
        names = [f"{p.name}/ ({', '.join(_listing(p, 4)) or 'empty'})" if p.is_dir() else p.name for p in left]
        problems.append(f"left in $TMPDIR ({tmpdir}): {', '.join(names)}")
    named = _named_in(page_text)
    left = sorted(n for n in tmp_entries() - tmp_before if named(n))
    if left:
        problems.append(f"left in /tmp: {', '.join('/tmp/' + n for n in left)}")
    return problems
