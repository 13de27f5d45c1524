"""Schedule: a plan's per-rank action rows lowered, validated, dry-run, simulated and refined.

Takes compute orders (:mod:`partitioner.orders`) and a stage topology; gives
lowered schedules with their messages (:mod:`~partitioner.schedule.lower`), a
discrete-event simulation of a plan's step (:mod:`~partitioner.schedule.simulate`,
events as :mod:`~partitioner.schedule.timeline`), and splits improved under that
simulation (:mod:`~partitioner.schedule.refine`).

May import: ``solve``, ``cost``, ``graph``, ``plan`` and the flat base; never
``report``, ``search`` or ``cli``.  ``lower`` imports without torch.
"""

__all__: list[str] = []
