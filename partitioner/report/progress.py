"""Progress on stderr: status lines, one updating line per long phase, and torch's noise kept out.

On a terminal a phase ("measuring costs") is one line rewritten in place with ``\\r``
(done/total and elapsed time); elsewhere (a log file, CI) it is one plain line when
the phase ends, plus one every :data:`PLAIN_EVERY` seconds while it runs.  Pure
Python: no torch.

Example::

    >>> import io
    >>> out = io.StringIO()
    >>> say = Reporter(stream=out, tty=False, clock=iter([0.0, 0.0, 0.5, 1.0, 2.0]).__next__)
    >>> say("captured 3 compute nodes")
    >>> for done in (1, 2, 3):
    ...     report_progress(say, "counting costs", done, 3, unit="nodes")
    >>> print(out.getvalue(), end="")
    [autopartition] captured 3 compute nodes
    [autopartition] counting costs: 3/3 nodes in 2.00 s
"""

from __future__ import annotations

import contextlib
import io
import logging
import sys
import time
from collections.abc import Callable, Iterator
from typing import TextIO

from partitioner.units import format_seconds

__all__ = ["PLAIN_EVERY", "PREFIX", "Reporter", "hide_library_output", "report_progress"]

PREFIX = "[autopartition] "
PLAIN_EVERY = 10.0  # seconds between plain progress lines of one phase (not a terminal)
_REDRAW_EVERY = 0.1  # seconds between rewrites of a terminal's progress line


class Reporter:
    """A status callable (``say("message")``) that also draws per-phase progress.

    Pass it as ``status=`` to :func:`partitioner.compile`; the planner calls
    :meth:`progress` through :func:`report_progress`.  ``stream`` defaults to the
    ``sys.stderr`` of the moment the reporter is made, so it keeps writing there while
    :func:`hide_library_output` swaps ``sys.stderr`` out.
    """

    def __init__(
        self,
        *,
        stream: TextIO | None = None,
        quiet: bool = False,
        tty: bool | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.quiet = quiet
        self.tty = _isatty(self.stream) if tty is None else tty
        self.clock = clock
        self._phase: str | None = None  # the phase whose line is open (drawn, not ended)
        self._start = clock()  # when the current phase began: the last line before it
        self._drawn = 0.0  # when the open phase was last drawn
        self._width = 0  # characters of the terminal line drawn last (padded over when shorter)

    def __call__(self, message: str) -> None:
        """One status line (ending an open progress line first)."""
        if self.quiet:
            return
        self._end_line()
        self._write(f"{PREFIX}{message}\n")
        self._start = self.clock()

    def progress(self, phase: str, done: int, total: int, *, unit: str = "") -> None:
        """``done`` of ``total`` in ``phase``: redraw (terminal) or a plain line when due."""
        if self.quiet:
            return
        now = self.clock()
        if phase != self._phase:
            self._end_line()
            self._phase, self._drawn = phase, self._start
        finished = done >= total
        # Called once per graph node: the line is only formatted when it is drawn.
        if not finished and now - self._drawn < (_REDRAW_EVERY if self.tty else PLAIN_EVERY):
            return
        count = f"{done}/{total}{' ' + unit if unit else ''}"
        elapsed = format_seconds(now - self._start)
        text = f"{PREFIX}{phase}: {count} in {elapsed}" if finished else f"{PREFIX}{phase}: {count}, {elapsed}"
        if self.tty:
            self._write("\r" + text.ljust(self._width) + ("\n" if finished else ""))
            self._width, self._drawn = (0, now) if finished else (len(text), now)
        else:
            self._write(text + "\n")
            self._drawn = now
        if finished:
            self._phase, self._start = None, now

    def _end_line(self) -> None:
        if self._phase is not None and self.tty and self._width:
            self._write("\n")  # leave the unfinished phase's last state on screen
        self._phase, self._width = None, 0

    def _write(self, text: str) -> None:
        self.stream.write(text)
        self.stream.flush()


def report_progress(status: Callable[[str], None], phase: str, done: int, total: int, *, unit: str = "") -> None:
    """Progress to ``status``: its ``progress`` method when it has one (a :class:`Reporter`),
    else one plain message when the phase ends (a plain callable gets no per-item lines)."""
    method = getattr(status, "progress", None)
    if callable(method):
        method(phase, done, total, unit=unit)
    elif done >= total:
        status(f"{phase}: {done}/{total}{' ' + unit if unit else ''}")


@contextlib.contextmanager
def hide_library_output(*, verbose: bool = False) -> Iterator[io.StringIO]:
    """Keep torch's warnings, log records and graph dumps (printed to ``sys.stderr``) from the user.

    ``sys.stderr`` is swapped for a buffer (export prints a failing graph there with
    ``print``) and logging is disabled below CRITICAL (torch's handlers hold the real
    stream).  The buffer is yielded, for an internal error's report.  ``verbose`` turns
    all of this off.
    """
    hidden = io.StringIO()
    if verbose:
        yield hidden
        return
    previous_stderr, previous_disable = sys.stderr, logging.root.manager.disable
    sys.stderr = hidden
    logging.disable(logging.ERROR)
    try:
        yield hidden
    finally:
        sys.stderr = previous_stderr
        logging.disable(previous_disable)


def _isatty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # closed or not a real file
        return False
