"""The command line's options are frozen: each command's, with its default, is in tests/cli_options.json.

A new option, a renamed one or a changed default fails here until the list is updated in the
same commit and docs/cli.md says why: the command line does not grow by accident.  Every
command's parser is a ``_<command>_parser()`` of :mod:`partitioner.cli` (``plan`` is the
command a model file starts); argparse's own ``-h``/``--help`` is left out.  Keys starting
with ``-`` are options (their option strings joined by ", "), the others positionals (their
metavar); each maps to its default.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

from partitioner import cli

ROOT = Path(__file__).resolve().parent.parent
FROZEN = ROOT / "tests" / "cli_options.json"
DOCS = ROOT / "docs" / "cli.md"
CHANGED = ("the command line changed: a new option is a decision; update tests/cli_options.json in the same "
           "commit and say why in docs/cli.md")


def _parsers() -> dict[str, argparse.ArgumentParser]:
    """Every command's parser, by command name, from cli's ``_<command>_parser`` functions."""
    found = {}
    for name, value in vars(cli).items():
        command = re.fullmatch(r"_([a-z]+)_parser", name)
        if command and callable(value):
            found[command.group(1)] = value()
    return found


def _arguments(parser: argparse.ArgumentParser) -> dict[str, Any]:
    arguments = {}
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        key = ", ".join(action.option_strings) if action.option_strings else str(action.metavar or action.dest)
        arguments[key] = action.default
    return arguments


def current() -> dict[str, dict[str, Any]]:
    """The command line as it is: ``{command: {argument: default}}``, as JSON would read it back."""
    found = {command: _arguments(parser) for command, parser in _parsers().items()}
    return json.loads(json.dumps(found, sort_keys=True))


def _difference(frozen: dict[str, dict[str, Any]], now: dict[str, dict[str, Any]]) -> list[str]:
    lines = [f"new command {c}" for c in sorted(set(now) - set(frozen))]
    lines += [f"command {c} is gone" for c in sorted(set(frozen) - set(now))]
    for command in sorted(set(now) & set(frozen)):
        old, new = frozen[command], now[command]
        lines += [f"{command}: new {k} (default {new[k]!r})" for k in sorted(set(new) - set(old))]
        lines += [f"{command}: {k} is gone" for k in sorted(set(old) - set(new))]
        lines += [f"{command}: {k} default {old[k]!r} -> {new[k]!r}"
                  for k in sorted(set(old) & set(new)) if old[k] != new[k]]
    return lines


def test_the_command_line_is_as_frozen() -> None:
    frozen = json.loads(FROZEN.read_text())
    now = current()
    assert now == frozen, CHANGED + ":\n  " + "\n  ".join(_difference(frozen, now))


def test_the_frozen_list_is_sorted_one_command_a_key() -> None:
    text = FROZEN.read_text()
    assert text == json.dumps(json.loads(text), sort_keys=True, indent=2) + "\n", \
        "write tests/cli_options.json as json.dumps(..., sort_keys=True, indent=2) and a newline"


def test_every_option_is_in_the_docs() -> None:
    docs = DOCS.read_text()
    missing = [f"{command} {option}" for command, arguments in sorted(json.loads(FROZEN.read_text()).items())
               for key in arguments if key.startswith("-") for option in key.split(", ")
               if not re.search(re.escape(option) + r"(?![\w-])", docs)]
    assert not missing, f"docs/cli.md does not mention {', '.join(missing)}"


def test_the_checks_see_a_change(monkeypatch: Any) -> None:
    """Not vacuous: an option added to a command is found, and so is a changed default."""
    frozen = current()
    plan = cli._plan_parser

    def grown() -> argparse.ArgumentParser:
        parser = plan()
        parser.add_argument("--new-option", default=3)
        return parser

    monkeypatch.setattr(cli, "_plan_parser", grown)
    now = current()
    assert _difference(frozen, now) == ["plan: new --new-option (default 3)"]
    changed = {**frozen, "show": {**frozen["show"], "DIR": "x"}}
    assert _difference(changed, frozen) == ["show: DIR default 'x' -> None"]
