"""Every failure cause has its own message and log line, and the guide's fault table matches the
suite: each row names a test that exists, each message it quotes is in the code, and each fault
the suite counts has its row."""

from __future__ import annotations

import ast
import re
import socket
import threading
from pathlib import Path

import pytest
from faultlib import HERE
from wcache.daemon import rank as daemon
from wcache import errors
from wcache.daemon import launcher
from wcache.daemon import seed
from wcache.errors import DAEMON_ERRORS, FALLBACK, REASONS, CacheUnusable
from wcache.engine.loading.config import LoaderConfig
from wcache.engine.loading.client import CacheClient
from wcache.wire.protocol import recv_frame, reply, send_frame

ROOT = HERE.parent.parent
PACKAGE = ROOT / "reference_impl" / "wcache"
PAGE = ROOT / "docs" / "faults.md"
PLACEHOLDER = re.compile(r"\{[^{}]*\}|%[sdr]|\.\.\.")


def normalized(text: str) -> str:
    return PLACEHOLDER.sub("{}", text)


def message_templates() -> dict[str, str]:
    """Every message template: errors.py's strings, dicts of strings and class attributes, and the
    named message constants of the daemon, the launcher and the seed listener."""
    out = {}
    for name, value in vars(errors).items():
        if name.startswith("_"):
            continue
        if isinstance(value, str):
            out[f"errors.{name}"] = value
        elif isinstance(value, dict) and value and all(isinstance(v, str) for v in value.values()):
            out.update({f"errors.{name}[{k!r}]": v for k, v in value.items()})
        elif isinstance(value, type) and value.__module__ == errors.__name__:
            out.update({f"errors.{name}.{a}": v for a, v in vars(value).items()
                        if isinstance(v, str) and not a.startswith("_")})
    for module in (daemon, launcher, seed):
        out.update({f"{module.__name__}.{n}": v for n, v in vars(module).items()
                    if n.isupper() and isinstance(v, str) and " " in v
                    and v is not getattr(errors, n, None)})  # not one imported from errors.py
    return out


def test_no_two_failure_causes_share_a_message():
    templates = message_templates()
    assert len(templates) > 50, sorted(templates)
    seen: dict[str, str] = {}
    for name, text in sorted(templates.items()):
        key = normalized(text)
        assert key not in seen, f"{name} and {seen[key]} say the same thing: {text!r}"
        seen[key] = name
    # The engine's log line for each fallback reason is its own too (it embeds the reason).
    lines = {FALLBACK.format(reason=normalized(r)) for r in REASONS.values()}
    assert len(lines) == len(REASONS)


def refusals() -> dict[str, set[str]]:
    """Error kind -> the message expressions of every refusal in daemon/rank.py (reply(False, ...) and
    self._refuse(conn, kind, message))."""
    kinds: dict[str, set[str]] = {}
    for node in ast.walk(ast.parse((PACKAGE / "daemon" / "rank.py").read_text())):
        if not isinstance(node, ast.Call):
            continue
        fn = ast.unparse(node.func)
        kw = {k.arg: k.value for k in node.keywords}
        if fn == "reply" and node.args and ast.unparse(node.args[0]) == "False":
            kind, message = kw["error"], kw["message"]
        elif fn == "self._refuse":
            kind, message = node.args[1], node.args[2]
        else:
            continue
        assert not isinstance(message, (ast.Constant, ast.JoinedStr)), (
            f"an inline message in daemon.py: {ast.unparse(message)} (name it in errors.py)")
        kinds.setdefault(ast.literal_eval(kind) if isinstance(kind, ast.Constant) else ast.unparse(kind),
                         set()).add(ast.unparse(message))
    return kinds


def test_every_daemon_error_kind_has_its_own_message():
    kinds = refusals()
    assert set(kinds) == {"protocol", "mismatch", "released", "rejected", "busy", "in_use", "release_failed",
                          "unread", "fds_in_flight", "error"}, kinds  # "error": _refuse's own parameter
    kinds.pop("error")
    protocol = kinds.pop("protocol")
    assert protocol == {"str(e)", "DAEMON_ERRORS['bad_get_state'].format(modes=list(MODES))",
                        "DAEMON_ERRORS['unknown_op'].format(op=str(op)[:64])"}
    # "busy" has two causes, each with its own text: too many connections, too many bytes in flight.
    assert kinds.pop("busy") == {"message", "DAEMON_ERRORS['busy_bytes'].format(held=e.held, limit=e.limit)"}
    singles = {kind: next(iter(m)) for kind, m in kinds.items()}
    assert all(len(m) == 1 for m in kinds.values()), kinds
    assert len(set(singles.values())) == len(singles), singles


SAMPLES = {  # each refusal as the daemon sends it
    "mismatch": reply(False, error="mismatch", fields=["dtype"], message=REASONS["mismatch"].format(fields=["dtype"])),
    "released": reply(False, error="released", message=REASONS["released"]),
    "rejected": reply(False, error="rejected", message=REASONS["rejected"].format(uid=1234)),
    "busy": reply(False, error="busy", message=DAEMON_ERRORS["busy"].format(max=256)),
    "in_use": reply(False, error="in_use", message=DAEMON_ERRORS["in_use"].format(n=2)),
    "release_failed": reply(False, error="release_failed", message=DAEMON_ERRORS["release_failed"].format(error="x")),
    "protocol": reply(False, error="protocol", message=DAEMON_ERRORS["unknown_op"].format(op="x")),
    "fds_in_flight": reply(False, error="fds_in_flight", message=DAEMON_ERRORS["fds_in_flight"].format(uid=1234, limit=1024)),
}


def test_each_refusal_reaches_the_engine_as_its_own_reason(tmp_path):
    """A real socket answering each refusal in turn: the loader's reasons (and so its fallback log
    lines) all differ, and the kinds with a reason of their own get it."""
    path = tmp_path / "refusals.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(8)
    answers = list(SAMPLES.values())

    def serve():
        for answer in answers:
            conn, _ = listener.accept()
            with conn:
                recv_frame(conn)
                send_frame(conn, answer)

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    reasons = {}
    for kind in SAMPLES:
        client = CacheClient(path, LoaderConfig())
        try:
            with pytest.raises(CacheUnusable) as err:
                client.call("get_state", key={}, mode="zero_copy")
        finally:
            client.close()
        reasons[kind] = (err.value.kind, str(err.value))
    t.join(10)
    listener.close()
    assert {k: v[0] for k, v in reasons.items()} == {"mismatch": "mismatch", "released": "released",
                                                      "rejected": "rejected", "busy": "busy", "in_use": "protocol",
                                                      "release_failed": "protocol", "protocol": "protocol",
                                                      "fds_in_flight": "fds_in_flight"}
    texts = [v[1] for v in reasons.values()]
    assert len(set(texts)) == len(texts), reasons
    assert len({FALLBACK.format(reason=t) for t in texts}) == len(texts)


# -- the guide's table ----------------------------------------------------------------------------
def table_rows() -> list[dict]:
    rows = []
    for line in PAGE.read_text().splitlines():
        if not line.startswith("| ") or set(line.replace("|", "").strip()) <= set("-: "):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
        if cells[0] == "Fault":
            continue
        assert len(cells) == 4, line
        rows.append({"fault": cells[0], "sees": re.findall(r"`([^`]+)`", cells[1]), "test": cells[3],
                     "tests": re.findall(r"`(tests/[^`]+?)::(\w+)`", cells[3])})
    return rows


def code_strings() -> list[str]:
    """Every string constant of the package, and the literal parts of its f-strings."""
    out = []
    for f in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                out.append(node.value)
    return out


def tallied_faults() -> list[str]:
    names = []
    for f in sorted(HERE.glob("test_fault_*.py")):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Call) and ast.unparse(node.func) == "TALLY.fault":
                names.extend(ast.literal_eval(a) for a in node.args)
    return names


def test_the_fault_table_in_the_guide_matches_the_suite():
    rows = table_rows()
    assert len(rows) >= 20
    strings = code_strings()
    for row in rows:
        assert row["tests"], f"row {row['fault']!r} names no test"
        for file, name in row["tests"]:
            source = ROOT / file
            assert source.is_file(), f"row {row['fault']!r}: no {file}"
            assert re.search(rf"^def {name}\(", source.read_text(), re.MULTILINE), f"row {row['fault']!r}: no {file}::{name}"
        assert row["sees"], f"row {row['fault']!r} quotes no message"
        for quote in row["sees"]:
            for piece in PLACEHOLDER.split(quote):
                piece = piece.strip()
                if len(piece) >= 4:
                    assert any(piece in s for s in strings), f"row {row['fault']!r}: {piece!r} is not in the code"
    # Each fault the suite counts has exactly one row, and each test of the suite has a row.
    faults = [r["fault"].lower() for r in rows]
    for name in tallied_faults():
        assert faults.count(name.lower()) == 1, f"no row (or several) for the fault {name!r}"
    named = {name for r in rows for _, name in r["tests"]}
    for f in sorted(HERE.glob("test_fault_*.py")):
        if f.name == Path(__file__).name:
            continue
        for test in re.findall(r"^def (test_\w+)\(", f.read_text(), re.MULTILINE):
            assert test in named, f"{f.name}::{test} is in no row of {PAGE.name}"


def test_the_daemon_dispatches_on_the_protocols_op_table():
    """protocol.REQUESTS is the table the daemon dispatches on (one handler each, no other), and the
    refusal of an unknown op names exactly those."""
    from wcache.wire.protocol import REQUESTS

    assert tuple(daemon.RankDaemon.HANDLERS) == REQUESTS
    listed = re.findall(r"get_\w+|release", DAEMON_ERRORS["unknown_op"].split(";")[1])
    assert tuple(listed) == REQUESTS
