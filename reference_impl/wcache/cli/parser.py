"""The argparse parser every ``wcache`` command uses: defaults in ``--help``, and a mistyped flag
named together with the nearest valid one, in the usage of the command it was given to.

Plain argparse hands a subcommand's unknown flags back to the top-level parser, which prints the
top-level usage ("unrecognized arguments"), and checks required flags first, so ``wcache preload
--modle x`` only said that --model is required. Here each parser checks its own words before
parsing them.
"""

from __future__ import annotations

import argparse
import difflib
import re

_NUMBER = re.compile(r"^-\d+$|^-\d*\.\d+$")  # argparse reads these as values, not flags


class HelpFormatter(argparse.HelpFormatter):
    """Appends "(default: X)" to a flag's help where the flag has a default worth stating: not for
    unset (None) defaults, switches that are off, or help that already says its default."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if (not action.option_strings or default is None or default is argparse.SUPPRESS
                or "default" in text or isinstance(action, argparse._HelpAction)):
            return text
        if action.nargs == 0 and not isinstance(action, argparse.BooleanOptionalAction) and default is False:
            return text  # a store_true switch: "off" is what its absence means
        if isinstance(default, bool):
            shown = "on" if default else "off"
        elif isinstance(default, list):
            if not default:
                return text
            shown = " ".join(map(str, default))
        else:
            shown = "%(default)s"
        return f"{text} (default: {shown})".lstrip()


class Parser(argparse.ArgumentParser):
    """An ArgumentParser that refuses an unknown flag by name before anything else is checked."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def parse_known_args(self, args=None, namespace=None):
        if args is not None:
            self._refuse_unknown_flags(list(args))
        return super().parse_known_args(args, namespace)

    def _known(self, name: str) -> argparse.Action | None:
        """The action ``name`` selects, as argparse reads it (an unambiguous prefix of a long flag
        is accepted too, as argparse's abbreviations are)."""
        if name in self._option_string_actions:
            return self._option_string_actions[name]
        if self.allow_abbrev and name.startswith("--"):
            hits = {a for s, a in self._option_string_actions.items() if s.startswith(name)}
            if len(hits) == 1:
                return hits.pop()
        return None

    def _refuse_unknown_flags(self, words: list[str]) -> None:
        has_commands = self._subparsers is not None
        i = 0
        while i < len(words):
            word = words[i]
            i += 1
            if word == "--":
                return
            if not word.startswith("-") or word == "-" or _NUMBER.match(word):
                if has_commands:
                    return  # the rest belongs to the command, whose parser checks it
                continue
            name = word.split("=", 1)[0]
            action = self._known(name)
            if action is None:
                self.error(self.unknown_flag(name))
            if action.nargs != 0 and "=" not in word and not isinstance(action, argparse._SubParsersAction):
                i += 1  # its value, which may itself start with "-"

    def unknown_flag(self, name: str) -> str:
        flags = [s for s in self._option_string_actions if s.startswith("--") or not name.startswith("--")]
        near = difflib.get_close_matches(name, flags, n=1, cutoff=0.5)
        hint = f"did you mean {near[0]}?" if near else f"see {self.prog} --help"
        return f"unrecognized argument {name}; {hint}"
