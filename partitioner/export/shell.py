"""An exported command line as shell lines: the launcher, then one option (with its values) per line.

>>> shell_lines(["torchrun", "train.py", "--tp", "2", "--pp", "4"], launcher=2)
['  torchrun train.py \\\\', '      --tp 2 \\\\', '      --pp 4']
"""

from __future__ import annotations

import shlex
from collections.abc import Callable, Sequence

__all__ = ["shell_lines"]


def _is_option(word: str) -> bool:
    return word.startswith("--")


def shell_lines(command: Sequence[str], *, launcher: int,
                starts_option: Callable[[str], bool] = _is_option) -> list[str]:
    """``command`` continued with backslashes: its first ``launcher`` words on one line (none: 0), then a line per
    word ``starts_option`` accepts, with the words after it up to the next."""
    groups: list[list[str]] = [list(command[:launcher])] if launcher else []
    for word in command[launcher:]:
        if not groups or starts_option(word):
            groups.append([word])
        else:
            groups[-1].append(word)
    lines = [("  " if i == 0 else "      ") + shlex.join(group) for i, group in enumerate(groups)]
    return [line + " \\" for line in lines[:-1]] + lines[-1:]
