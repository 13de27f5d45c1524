"""Cost: what every node and edge of a captured graph costs on a device.

Takes a captured graph; gives each node's forward/backward seconds (measured here,
or predicted for a target GPU from :mod:`~partitioner.cost.devices`), FLOPs,
parameter and activation bytes (:mod:`~partitioner.cost.nodes`,
:mod:`~partitioner.cost.measured`), what a split backward adds
(:mod:`~partitioner.cost.splitcost`), message and all-reduce times
(:mod:`~partitioner.cost.comm`), precision and optimizer bytes
(:mod:`~partitioner.cost.precision`) and a calibration's numbers
(:mod:`~partitioner.cost.calibration`).

May import: ``graph`` and the flat base (``errors``, ``units``, ``defaults``,
``orders``).  Never ``runtime``: the split backward ``splitcost`` times is the
graph's (:mod:`~partitioner.graph.splitbackward`), the same code the runtime runs, so
the planner charges what will run.
"""

__all__: list[str] = []
