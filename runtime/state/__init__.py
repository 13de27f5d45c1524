"""State: the values of a rank's stages: made real, read from weights or a checkpoint, cast.

Takes the stages :mod:`runtime.execute` built; gives their tensors real values
(:mod:`~runtime.state.materialise`: a meta model initialised per module under seeds
every partition shares), reads a safetensors or DCP file's tensors by their original
names (:mod:`~runtime.state.weights`), saves and loads checkpoints loadable under any
plan (:mod:`~runtime.state.checkpoint`, in the directory layout of
:mod:`~runtime.state.folders`) and runs stages under the plan's precision
(:mod:`~runtime.state.precision`); :mod:`~runtime.state.values` holds the stage
stack's value steps (load, at precision, on the device, cast, precision wrappers).

May import: ``execute`` and the planner's graph, cost (dtype names), plan and base;
never ``parallel``, ``engines`` or ``launch``.  ``folders`` imports without torch.
"""

__all__: list[str] = []
