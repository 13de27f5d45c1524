"""Progress output: one updating line per phase on a terminal, one plain line elsewhere; torch's noise hidden."""

from __future__ import annotations

import io
import itertools
import logging
import sys

from partitioner.report.progress import PLAIN_EVERY, Reporter, hide_library_output, report_progress


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _run_phase(reporter: Reporter, clock: _Clock, total: int, step: float) -> None:
    reporter("captured 147 compute nodes")
    for done in range(1, total + 1):
        clock.now += step
        report_progress(reporter, "measuring costs", done, total, unit="nodes")
    reporter("solving 1 stage x 4 replicas")


def test_not_a_terminal_one_line_per_phase() -> None:
    """Issue 10: 11-14 lines of "counting costs: node 15/154"; now one line with the elapsed time."""
    out, clock = io.StringIO(), _Clock()
    _run_phase(Reporter(stream=out, tty=False, clock=clock), clock, 147, 0.01)
    assert out.getvalue().splitlines() == [
        "[autopartition] captured 147 compute nodes",
        "[autopartition] measuring costs: 147/147 nodes in 1.47 s",
        "[autopartition] solving 1 stage x 4 replicas",
    ]


def test_not_a_terminal_long_phase_says_it_is_alive() -> None:
    out, clock = io.StringIO(), _Clock()
    _run_phase(Reporter(stream=out, tty=False, clock=clock), clock, 100, PLAIN_EVERY / 20)  # 50 s in all
    lines = [line for line in out.getvalue().splitlines() if "costs" in line]
    assert 4 <= len(lines) <= 6 and lines[-1].endswith("100/100 nodes in 50.0 s")
    assert lines[0] == "[autopartition] measuring costs: 20/100 nodes, 10.0 s"


def test_terminal_rewrites_one_line() -> None:
    out, clock = io.StringIO(), _Clock()
    _run_phase(Reporter(stream=out, tty=True, clock=clock), clock, 147, 0.01)
    text = out.getvalue()
    lines = text.split("\n")
    assert len(lines) == 4 and lines[-1] == ""  # status, the phase (one line), status
    phase = lines[1]
    assert phase.startswith("\r[autopartition] measuring costs: ")
    frames = phase.split("\r")[1:]
    assert 10 <= len(frames) <= 16  # redrawn about every 0.1 s, not per node
    assert frames[-1].rstrip() == "[autopartition] measuring costs: 147/147 nodes in 1.47 s"
    assert all("/147 nodes" in f for f in frames)
    assert all(len(f) >= len(p.rstrip()) for p, f in itertools.pairwise(frames))  # a shorter frame pads the old


def test_terminal_unfinished_phase_ends_its_line_before_the_next_message() -> None:
    out, clock = io.StringIO(), _Clock()
    reporter = Reporter(stream=out, tty=True, clock=clock)
    clock.now = 1.0
    reporter.progress("measuring costs", 3, 10, unit="nodes")
    reporter("something else")
    assert out.getvalue() == ("\r[autopartition] measuring costs: 3/10 nodes, 1.00 s\n"
                              "[autopartition] something else\n")


def test_quiet_and_plain_callables() -> None:
    out = io.StringIO()
    quiet = Reporter(stream=out, quiet=True)
    quiet("hello")
    report_progress(quiet, "phase", 1, 1)
    assert out.getvalue() == ""
    said: list[str] = []
    for done in range(1, 11):
        report_progress(said.append, "counting costs", done, 10, unit="nodes")
    assert said == ["counting costs: 10/10 nodes"]  # a plain status callable: one line at the end


def test_hide_library_output() -> None:
    """torch's export prints a partial graph to sys.stderr and logs warnings; neither reaches the user."""
    real = io.StringIO()
    handler = logging.StreamHandler(real)
    logger = logging.getLogger("torch.fx.experimental.symbolic_shapes.test")
    logger.addHandler(handler)
    previous = sys.stderr
    sys.stderr = real
    try:
        reporter = Reporter(stream=real, tty=False)
        with hide_library_output() as hidden:
            print("def forward(self, arg0_1):", file=sys.stderr)
            logger.warning("Unable to find user code corresponding to {u0}")
            reporter("our message")
        assert real.getvalue() == "[autopartition] our message\n"
        assert "def forward" in hidden.getvalue()
        with hide_library_output(verbose=True):
            print("def forward(self, arg0_1):", file=sys.stderr)
            logger.warning("Unable to find user code")
        assert "def forward" in real.getvalue() and "Unable to find user code" in real.getvalue()
    finally:
        sys.stderr = previous
        logger.removeHandler(handler)
    assert logging.root.manager.disable == logging.NOTSET
