"""Launch: ``autopartition run``: torchrun started over a plan's ranks, and their failures reported.

Takes a saved plan and a training script; refuses (through the layers below) what the
runtime cannot run before any rank starts, then runs torchrun in its own session
(:mod:`~runtime.launch.torchrun`) with each rank under
:mod:`~runtime.launch.failure`, which records a rank's error (cause, frame, rank,
stage, action) for the launcher's one summary.

May import every runtime subpackage below it (inside functions: this package
imports without torch, so ``autopartition run --help`` stays cheap).
"""

__all__: list[str] = []
