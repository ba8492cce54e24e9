"""docs/faults-attacks.json is one run's record of the attack tests, and docs/faults.md agrees with
it and with the code.

* The record names its run (time, commit, command) and holds exactly the attacks that
  tests/faults/test_fault_attacks.py and test_fault_http.py measure: a partial or merged record, or one missing an attack
  added since, fails.
* Every figure keeps the code's bound for it (tests/faults/attacklib.py BOUNDS, the same check the
  test made when it measured it).
* The bounds the page states in words are the code's constants.
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "faults"))  # attacklib

from attacklib import BOUNDS, FIGURES_FILE, RECORD_COMMAND, bound_problems, measured_attacks  # noqa: E402
from wcache.daemon.rank import IN_FLIGHT_BYTES, REQUEST_TIMEOUT_S  # noqa: E402
from wcache.engine.api_server.http_front import DEFAULT_LIMITS as HTTP  # noqa: E402
from wcache.wire.handback import ASK_BUDGET_S  # noqa: E402
from wcache.wire.protocol import MAX_FDS  # noqa: E402

PAGE = ROOT / "docs" / "faults.md"

# A row of the page's attack table (by the start of its first cell) -> what it must say: the code's bound.
PAGE_WORDS = {
    "6 offers that accept and never answer": f"waits {ASK_BUDGET_S:g} s for all of them together",
    "A frame sent at 1 byte a second": f"{REQUEST_TIMEOUT_S:g} seconds bound the whole frame",
    "100 HTTP bodies that never finish": f"At most {HTTP.max_waiting_connections} waiting connections",
    "Large frames held in flight": f"Past {IN_FLIGHT_BYTES >> 20} MiB",
    "Descriptor flood": f"at most {2 * MAX_FDS} at once",
}


def record_problems(record: dict, page: str) -> list[str]:
    out = []
    run = record.get("run", {})
    out += [f"the record does not name its run's {k}" for k in ("utc", "commit", "command") if not run.get(k)]
    attacks = record.get("attacks", {})
    expected = measured_attacks()
    if set(attacks) != expected:
        out.append(f"the record holds {sorted(attacks)}, the attack tests measure {sorted(expected)}: "
                   f"publish one whole run ({RECORD_COMMAND})")
    for attack, values in attacks.items():
        out += bound_problems(attack, values)
    rows = [line for line in page.splitlines() if line.startswith("| ")]
    for start, words in PAGE_WORDS.items():
        row = [r for r in rows if r.startswith(f"| {start}")]
        if len(row) != 1 or words not in row[0]:
            out.append(f"docs/faults.md's row {start!r} does not say {words!r}")
    return out


def test_the_published_attack_record_is_one_whole_run_within_the_codes_bounds():
    record = json.loads(FIGURES_FILE.read_text(encoding="utf-8"))
    problems = record_problems(record, PAGE.read_text(encoding="utf-8"))
    assert not problems, "\n".join(problems)


def test_every_bound_names_an_attack_that_is_measured():
    assert set(BOUNDS) <= measured_attacks()


def test_the_record_check_reports_a_broken_record_or_page():
    """Negative controls: each kind of wrong record, and a page that states another bound, fail."""
    record = json.loads(FIGURES_FILE.read_text(encoding="utf-8"))
    page = PAGE.read_text(encoding="utf-8")
    assert record_problems(record, page) == []

    slow = copy.deepcopy(record)
    slow["attacks"]["6 silent offers"]["asked_s"] = ASK_BUDGET_S + 1
    assert any("asked_s" in p for p in record_problems(slow, page))
    partial = copy.deepcopy(record)
    del partial["attacks"]["descriptor flood"]
    assert any("the attack tests measure" in p for p in record_problems(partial, page))
    merged = copy.deepcopy(record)
    merged["attacks"]["an attack from another run"] = {}
    assert any("the attack tests measure" in p for p in record_problems(merged, page))
    anonymous = copy.deepcopy(record)
    del anonymous["run"]
    assert any("commit" in p for p in record_problems(anonymous, page))
    promised = page.replace(f"waits {ASK_BUDGET_S:g} s for all", f"waits {ASK_BUDGET_S + 3:g} s for all")
    assert any("6 offers" in p for p in record_problems(record, promised))
