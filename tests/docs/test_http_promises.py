"""The front door's promises on docs/security.md and docs/faults.md are the code's limits, which
tests/faults/test_fault_http.py enforces by attack: a changed default fails here until the pages
say the new value."""

from __future__ import annotations

from pathlib import Path

from wcache.engine.api_server.http_front import DEFAULT_LIMITS as L

DOCS = Path(__file__).resolve().parents[2] / "docs"


def rows(page: str, *needles: str) -> list[str]:
    return [line for line in (DOCS / page).read_text(encoding="utf-8").splitlines()
            if line.startswith("|") and all(n in line for n in needles)]


def test_security_states_the_limits_the_attack_tests_enforce():
    [can] = rows("security.md", "| A network client | Run completions")
    assert f"its {L.max_connections} connections" in can and f"up to {L.request_deadline_s:g} seconds each" in can
    assert f"({L.read_timeout_s:g} seconds if it pauses)" in can
    [deadline] = rows("security.md", "| A network client | Hold a request past")
    assert f"past {L.request_deadline_s:g} seconds from its first byte" in deadline
    assert f"past {L.head_grace_s:g} second" in deadline
    [idle] = rows("security.md", "| A network client | Starve new clients")
    assert f"after {L.idle_timeout_s:g} seconds idle" in idle


def test_faults_states_the_limits_the_attack_tests_enforce():
    [slow] = rows("faults.md", "sending their headers a line at a time")
    assert f"{L.request_deadline_s:g} s for the request line" in slow and f"head after {L.head_grace_s:g} s" in slow
    [idle] = rows("faults.md", "idle connections (silent")
    assert f"{L.max_waiting_connections + 1} idle connections" in idle and f"after {L.idle_timeout_s:g} s idle" in idle
    [bodies] = rows("faults.md", "HTTP bodies that never finish")
    assert f"At most {L.max_waiting_connections} waiting connections" in bodies
    assert f"apart from the {L.max_connections} working" in bodies
    assert f"{L.read_timeout_s:g} s per read and {L.request_deadline_s:g} s per request" in bodies
