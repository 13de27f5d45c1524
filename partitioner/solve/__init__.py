"""Solve: contiguous pipeline stages over a costed graph, minimising the predicted step.

Takes node costs; coarsens the graph into blocks (:mod:`~partitioner.solve.coarsen`),
formulates numbers-only problems (:mod:`~partitioner.solve.formulate`,
:mod:`~partitioner.solve.problem`, :mod:`~partitioner.solve.scaledcosts` per
replica count and micro-batch count) and solves them exactly
(:mod:`~partitioner.solve.interval`'s dynamic programs, :mod:`~partitioner.solve.ilp`
with PuLP/HiGHS); gives a stage per block and the
:class:`~partitioner.solve.blockgraph.BlockGraph` of the split.

May import: ``cost``, ``graph`` and the flat base.  ``problem``, ``interval`` and
``ilp`` import without torch (numbers in, numbers out).
"""

__all__: list[str] = []
