"""Capture: the user's ``nn.Module`` as a torch.fx graph, with shapes and values on its nodes.

Takes a model and example inputs; gives a :class:`~partitioner.graph.capture.CapturedModel`
(``torch.export`` non-strict, or symbolic tracing) whose nodes carry ``node.meta``
tensor metadata (:mod:`~partitioner.graph.meta`) and propagated values
(:mod:`~partitioner.graph.values`); :mod:`~partitioner.graph.ir` holds the helpers
every later pass reads the graph with.  The split backward is a graph transform and
lives here too, below both the cost model that times it and the runtime that runs it:
:mod:`~partitioner.graph.meetings` marks where weights meet activations in a stage
graph, :mod:`~partitioner.graph.splitbackward` runs B (input gradients) and W (weight
gradients) from one autograd graph.

May import: ``partitioner.errors``, ``units``, ``defaults``, ``orders`` and torch.
Nothing above it (cost, solve, plan, schedule, report, search, cli, runtime).
"""

__all__: list[str] = []
