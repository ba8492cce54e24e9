"""Facts the guide states in prose, checked against the code's constants (so a change to one fails
here until the page says the same)."""

from __future__ import annotations

import re
from pathlib import Path

from wcache.daemon import rank
from wcache.cli.flags import DEFAULT_TIMEOUT_S
from wcache.wire import protocol

DOCS = Path(__file__).resolve().parents[2] / "docs"


def prose(page: str) -> str:
    """The page's text with line breaks as spaces."""
    return " ".join((DOCS / page).read_text(encoding="utf-8").split())


def n(value: int) -> str:
    return f"{value:,}"


def test_security_states_the_daemon_s_request_bounds():
    text = prose("security.md")
    stated = (f"frames of at most {protocol.MAX_FRAME_BYTES >> 20} MiB with at most {protocol.MAX_FDS} descriptors",
              f"{rank.REQUEST_TIMEOUT_S:g} seconds for a whole request",
              f"at most {n(rank.REQUEST_CONTAINERS)} lists and objects, {n(rank.REQUEST_ITEMS)} elements and "
              f"{protocol.MAX_DEPTH} levels of nesting per request",
              f"{rank.IN_FLIGHT_BYTES >> 20} MiB of large requests in flight",
              f"{rank.MAX_CLIENTS} connections per rank",
              f"at most {n(protocol.MAX_CONTAINERS)} lists and objects and {n(protocol.MAX_ITEMS)} elements per frame")
    for fact in stated:
        assert fact in text, f"docs/security.md does not say {fact!r}"


def test_quickstart_states_wait_s_default_timeout():
    assert f"It gives up after {DEFAULT_TIMEOUT_S:g} seconds (`--timeout`)" in prose("quickstart.md")


def test_wait_waits_as_long_as_an_engine_waits_for_its_daemon():
    """`wcache wait --health` on an engine that waits for its daemon must not give up first (it once
    gave up after 120 s, while the engine waited state_timeout_s, 300 s)."""
    from wcache.engine.loading.config import LoaderConfig

    assert DEFAULT_TIMEOUT_S == LoaderConfig().state_timeout_s


def test_memory_page_stops_what_it_starts():
    text = (DOCS / "memory.md").read_text(encoding="utf-8")
    assert re.search(r"^DAEMON=\$!$", text, re.M) and re.search(r"^ENGINE=\$!$", text, re.M)
    assert "kill $ENGINE $DAEMON" in text and 'rm -rf "$WORK"' in text


# -- What cuda_ipc and vmm_fd need, from the one record of the namespace matrix --------------------

import json  # noqa: E402

MATRIX = sorted((DOCS / "benchmarks").glob("*-ns-matrix-*.json"))


def matrix() -> dict[str, dict[str, bool]]:
    """transport -> case -> whether the engine mapped the daemon's memory."""
    out: dict[str, dict[str, bool]] = {}
    for path in MATRIX:
        d = json.loads(path.read_text())
        out[d["meta"]["transport"]] = {r["case"]: r["maps"] for r in d["rows"]}
    return out


def namespace_cases(cases: dict[str, bool]) -> dict[str, bool]:
    """The cases about namespaces and capabilities (the others change the user)."""
    return {c: ok for c, ok in cases.items() if "uid" not in c}


def test_gpu_transports_table_is_the_record():
    """Each row of the hand-written table (it adds a column that says what the row means) has the
    record's result in both transport columns."""
    m = matrix()
    assert set(m) == {"cuda_ipc", "vmm_fd"}, MATRIX
    text = (DOCS / "gpu-transports.md").read_text(encoding="utf-8")
    for case in m["cuda_ipc"]:
        row = next((ln for ln in text.splitlines() if ln.startswith(f"| {case} |")), None)
        assert row, f"gpu-transports.md has no row for {case!r}"
        cells = [c.strip() for c in row.split("|")[2:4]]
        want = ["maps" if m[t][case] else "fails" for t in ("cuda_ipc", "vmm_fd")]
        assert cells == want, f"{case!r}: the page says {cells}, the record {want}"


def test_every_page_says_what_the_record_says_about_cuda_ipc_and_namespaces():
    """The record: both transports mapped in every namespace case. Every page that says so rests on
    it, and no page says that cuda_ipc needs shared namespaces."""
    m = matrix()
    assert all(all(namespace_cases(cases).values()) for cases in m.values()), \
        "the record no longer maps in every namespace case: reword the sentences this test lists"
    claims = {"gpu-transports.md": "both transports mapped in every namespace combination tried",
              "validation.md": "the engine mapped the daemon's memory in every namespace case of that run",
              "differences-from-vllm.md": "wcache's `cuda_ipc` mapped in every namespace case measured"}
    for page, claim in claims.items():
        assert claim in prose(page), f"{page} no longer says {claim!r}"
    for page in sorted(DOCS.glob("*.md")):
        text = prose(page.name)
        assert not re.search(r"cuda_ipc`?[^.]{0,80}\bneeds? the same PID", text), page.name


def test_validation_does_not_deny_the_published_gpu_run_of_the_guide():
    runs = sorted((DOCS / "benchmarks").glob("*-guide-gpu-mode-*.txt"))
    text = prose("validation.md")
    if runs:
        assert "No run of them on a GPU has been published" not in text
        for run in runs:
            assert f"benchmarks/{run.name}" in text, f"validation.md does not link {run.name}"


def test_lifecycle_states_how_long_a_standby_waits_for_an_offer():
    assert f"waits up to {rank.OFFER_AFTER_TAKEOVER_S:g} seconds for an engine's offer" in prose("lifecycle.md")
