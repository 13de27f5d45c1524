"""Search: the layout around the stages: pp x dp, micro-batches, schedule and recomputation.

Takes a model and the user's options (:mod:`~partitioner.search.options`); runs
every pass below it per candidate layout (:mod:`~partitioner.search.layouts`),
assembles the chosen split into a :class:`~partitioner.plan.Plan`
(:mod:`~partitioner.search.assemble`); :func:`~partitioner.search.planner.compile`
is the entry point.  :mod:`~partitioner.search.calibrate` fits a calibration from
a traced run and predicts a plan again under it.

May import every pass (graph, cost, solve, plan, schedule, report); only ``cli``
sits above it.
"""

__all__: list[str] = []
