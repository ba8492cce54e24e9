"""What `wcache COMMAND --help` says: every default, and references into the guide that resolve."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest
from wcache import cli

DOCS = Path(__file__).resolve().parents[2] / "docs"
# "docs/lifecycle.md, A restarted daemon takes the weights back" or a bare "docs/autotune.md"
GUIDE_REF = re.compile(r"docs/(?P<page>[\w/-]+\.md)(?:, (?P<heading>[^;)]+))?")


def command_parser(command: str) -> argparse.ArgumentParser:
    parser = cli.build_parser(command)
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[command]


def flag_help(command: str, monkeypatch) -> str:
    monkeypatch.setenv("COLUMNS", "10000")  # one line per flag: no wrapping inside the texts
    return command_parser(command).format_help()


def flag_blocks(text: str) -> dict[str, str]:
    """First flag name -> its entry in --help (the invocation and its help, joined into one line)."""
    blocks: dict[str, str] = {}
    name = None
    for ln in text.splitlines():
        if ln.startswith("  -"):
            name = ln.split()[0].rstrip(",")
            blocks[name] = ln.strip()
        elif name and ln.startswith("    "):
            blocks[name] += " " + ln.strip()
        else:
            name = None
    return blocks


def stated_default(action: argparse.Action) -> str | None:
    """What "(default: ...)" must say for this flag, or None where nothing needs saying."""
    d = action.default
    if d is None or d is argparse.SUPPRESS or d == [] or isinstance(action, argparse._HelpAction):
        return None
    if isinstance(d, bool):
        if not d and not isinstance(action, argparse.BooleanOptionalAction):
            return None  # a store_true switch
        return "on" if d else "off"
    return str(d)


@pytest.mark.parametrize("command", list(cli.COMMANDS))
def test_every_default_is_shown_in_help(command, monkeypatch):
    blocks = flag_blocks(flag_help(command, monkeypatch))
    for action in command_parser(command)._actions:
        shown = stated_default(action)
        if shown is None or not action.option_strings:
            continue
        line = blocks[action.option_strings[0]]
        assert f"(default: {shown})" in line or ("default" in (action.help or "") and shown in line), line


def test_serve_help_says_the_api_binds_every_address_without_authentication(monkeypatch):
    line = flag_blocks(flag_help("serve", monkeypatch))["--host"]
    assert "no authentication" in line and "(default: 0.0.0.0)" in line, line


def headings(page: Path) -> set[str]:
    return {ln.lstrip("#").strip() for ln in page.read_text(encoding="utf-8").splitlines()
            if re.match(r"#{1,6} ", ln)}


def help_texts() -> list[tuple[str, str]]:
    """(where, text) of every help string and group title of every command."""
    out = []
    for command in cli.COMMANDS:
        p = command_parser(command)
        out += [(f"{command} {a.option_strings or a.dest}", a.help or "") for a in p._actions]
        out += [(f"{command} group", g.title or "") for g in p._action_groups]
    return out


def test_help_references_into_the_guide_resolve():
    refs = [(where, m) for where, text in help_texts() for m in GUIDE_REF.finditer(text)]
    assert refs, "no help text refers to the guide: the pattern no longer matches how they are written"
    for where, m in refs:
        page = DOCS / m["page"]
        assert page.is_file(), f"{where}: {m[0]!r}: no page {page}"
        if m["heading"]:
            assert m["heading"].strip() in headings(page), f"{where}: {m[0]!r}: no such heading in {m['page']}"


def test_transport_help_matches_how_auto_is_resolved():
    """auto picks vmm_fd when the CUDA driver offers the VMM calls (wire/transports/auto.py), called
    with ctypes: no Python package is involved."""
    text = next(a.help for a in command_parser("preload")._actions if "--weight-cache-transport" in a.option_strings)
    from wcache.wire.transports import auto, cuda_vmm

    assert "cuda-python" not in text and "libcuda.so.1" in text and "libcuda.so.1" in cuda_vmm.__doc__
    assert "cuda_vmm.available()" in Path(auto.__file__).read_text()
