"""Execute: what one rank's stages run with: the stage itself, its stack, its wire, its runner.

Takes a :class:`~partitioner.plan.Plan` and the user's model; gives each stage this
rank holds as a :class:`~runtime.execute.stage.LocalStage` (recaptured, checked
against the plan), the :class:`~runtime.execute.stack.StageStack` the layers above
build around them, the wire between stages (:mod:`~runtime.execute.comm`:
process groups, point-to-point sends with timeouts; :mod:`~runtime.execute.wire`:
which rank a peer is and what shape travels), per-layer recomputation
(:mod:`~runtime.execute.recompute`), the flat stage torch's engine drives
(:mod:`~runtime.execute.flatstage`) and our schedule runner
(:class:`~runtime.execute.runner.StepRunner`), which asks the stack's layers through
their hooks rather than knowing them.

The runtime's floor: imports no other runtime subpackage (``state``, ``parallel``,
``engines``, ``launch`` sit above it), only the planner's graph, plan and base; the
split backward the runner drives is the graph's (:mod:`partitioner.graph.meetings`,
:mod:`partitioner.graph.splitbackward`), which the cost model times too.
``wire`` imports without torch.
"""

__all__: list[str] = []
