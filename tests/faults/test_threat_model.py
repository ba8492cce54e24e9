"""docs/security.md backs each thing an attacker cannot do with named tests: each row of its
"cannot" table names at least one, and each named test exists (a function of that name in that file)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "security.md"


def cannot_rows(text: str) -> list[tuple[str, list[tuple[str, str]]]]:
    table = text[text.index("| Attacker | Cannot | Test |"):]
    rows = []
    for line in table.splitlines()[2:]:
        if not line.startswith("| "):
            break
        cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
        assert len(cells) == 3, line
        rows.append((cells[1], re.findall(r"`(tests/[^`]+?)::(\w+)`", cells[2])))
    return rows


def test_every_cannot_in_the_threat_model_names_tests_that_exist():
    rows = cannot_rows(PAGE.read_text())
    assert len(rows) >= 12, rows
    attackers = {line.split(" | ")[0].strip("| ") for line in PAGE.read_text().splitlines()
                 if line.startswith("| ") and line.count(" | ") == 2}
    for who in ("Another user", "Engine container", "A network client"):
        assert any(a.startswith(who) for a in attackers), who
    assert not missing_tests(rows), missing_tests(rows)


def missing_tests(rows) -> list[str]:
    missing = []
    for cannot, tests in rows:
        if not tests:
            missing.append(f"{cannot!r} names no test")
        for file, name in tests:
            source = ROOT / file
            if not source.is_file() or not re.search(rf"^def {name}\(", source.read_text(), re.MULTILINE):
                missing.append(f"{cannot!r}: no {file}::{name}")
    return missing


def test_the_check_reports_a_missing_test_and_a_row_without_one():
    text = ("| Attacker | Cannot | Test |\n| --- | --- | --- |\n"
            "| Another user | Fly. | `tests/faults/test_threat_model.py::test_that_does_not_exist` |\n"
            "| Another user | Swim. | none |\n")
    assert missing_tests(cannot_rows(text)) == [
        "'Fly.': no tests/faults/test_threat_model.py::test_that_does_not_exist", "'Swim.' names no test"]
