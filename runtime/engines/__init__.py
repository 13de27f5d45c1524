"""Engines: what runs a rank's schedule over its built stage stack: ours, or torch's.

Takes the stage stack the layers below built; :func:`~runtime.engines.runners.apply_runner`
hands it to our :class:`~runtime.execute.runner.StepRunner` or, with ``engine="torch"``,
to torch.distributed.pipelining's schedules (:mod:`~runtime.engines.torch_engine`); :mod:`~runtime.engines.choice` names
the engine a rank runs (``$AUTOPARTITION_ENGINE``).

May import: ``parallel``, ``state``, ``execute`` and the planner's plan and base;
never ``launch``.  ``choice`` imports without torch.
"""

__all__: list[str] = []
