"""Report: a plan made readable: the stage table, report.md, timelines and graph pictures.

Takes a :class:`~partitioner.plan.Plan` (and the simulation of it); gives the
terminal table (:mod:`~partitioner.report.table`), the plan directory's
``report.md`` and pictures (:mod:`~partitioner.report.markdown`,
:mod:`~partitioner.report.figures`, :mod:`~partitioner.report.graphfig`) and the
planner's progress lines (:mod:`~partitioner.report.progress`).

May import: ``schedule``, ``plan``, ``solve``, ``cost``, ``graph`` and the flat base;
never ``search`` or ``cli``.  matplotlib is imported only when drawing.
"""

__all__: list[str] = []
