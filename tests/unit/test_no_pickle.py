"""No pickle in the package: frames are JSON plus descriptors, so a peer can send data, never code."""

from __future__ import annotations

import re
from pathlib import Path

import wcache

PACKAGE = Path(wcache.__file__).parent
# pickle itself, its aliases and the loaders built on it.
FORBIDDEN = re.compile(r"\bimport\s+(c?pickle|dill|cloudpickle|shelve|marshal)\b|\bfrom\s+(c?pickle|dill|cloudpickle|"
                       r"shelve|marshal)\b|\b(c?pickle|dill|marshal)\.|\btorch\.load\(|multiprocessing\.(connection|Queue|Pipe)")


def test_the_scan_covers_the_package_and_would_see_an_import():
    files = sorted(PACKAGE.rglob("*.py"))
    assert {"wire/protocol.py", "daemon/rank.py", "engine/loading/ipc_cache.py", "wire/arena.py"} <= {str(f.relative_to(PACKAGE)) for f in files}
    assert FORBIDDEN.search("import pickle") and FORBIDDEN.search("x = pickle.loads(b)")
    assert FORBIDDEN.search("from pickle import loads") and FORBIDDEN.search("torch.load(f)")


def test_no_pickle_anywhere_in_reference_impl():
    hits = [f"{f.relative_to(PACKAGE.parent)}:{n}: {line.strip()}"
            for f in sorted(PACKAGE.parent.rglob("*.py"))
            for n, line in enumerate(f.read_text().splitlines(), 1) if FORBIDDEN.search(line)]
    assert hits == []
