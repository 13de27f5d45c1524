"""Benchmark the planner: predicted step time against standard pipeline splits; wall time.

Run it with ``tools/bench_planner.py`` (its docstring has the commands).  Modules:
:mod:`~tools.benchplanner.baselines` (the standard splits), :mod:`~tools.benchplanner.reference`
(exact optima, independent of the product's solver), :mod:`~tools.benchplanner.zoo` (models
and their problems), :mod:`~tools.benchplanner.tables` (rows and tables),
:mod:`~tools.benchplanner.wall` (wall time), :mod:`~tools.benchplanner.schedules` (the best
plan per pipeline schedule on the large examples), :mod:`~tools.benchplanner.cli` (``main``).

**Step time.**  For each GPT (``examples/gpt.py``) and pipeline width P, every split is
evaluated by the same cost function, ``partitioner.solve.problem.step_time(problem, stage_of,
microbatches=M)`` (GPipe: ``sum t + (M-1) max t``, transfers included), on the same
:class:`~partitioner.solve.problem.PartitionProblem`, built as the planner builds it (capture,
propagate_values, profile(measure=False), roofline times for ``--device h100``, coarsen,
graph_costs, formulate at dp = 1):

* ``ours``: ``compile(model, inputs, gpus=P, pp=P, device="h100")``, the real product path;
  its ``plan.solver.objective`` (re-evaluated on our problem as a consistency check).
* Baselines split *layers* (units: the ``wte``+``wpe`` embedding group, each ``blocks.i``, the
  ``ln_f``+``lm_head`` group), mapped onto the solver's blocks (a block belongs to the unit of
  its first node's module path; root-level nodes such as the embedding sum belong to the unit
  before them):

  - ``equal-layer``: the same number of units per stage, extras on the first stages
    (DeepSpeed ``partition_method="uniform"``);
  - ``equal-param``: contiguous, minimise the largest stage parameter count (DeepSpeed
    ``"parameters"``, PiPPy ``split_into_equal_size``); a tied weight counts in every unit
    that uses it, as DeepSpeed counts a tied layer's parameters;
  - ``by-time``: contiguous, minimise the largest stage compute time (torchgpipe
    ``balance_by_time``; its ``blockpartition.solve`` solves the same min-max problem);
  - ``best-layer``: the exact best contiguous whole-layer split under ``step_time``.

  min-max ties are broken as DeepSpeed's ``partition_balanced`` does: each stage takes as
  many units as the bottleneck allows, from the first stage on.
* ``ideal``: perfect balance with free communication, ``sum t + (M-1) sum t / P``; every
  other column is also shown as a ratio to it.

**Exact optimum.**  Where the block graph has few down-sets (every valid assignment is a
chain of down-sets, so a DP over them is exact), the best split over *all* valid
assignments of the solver's blocks is computed, along with the best contiguous split of
the blocks in their given order, and the gap of ``ours`` to it is reported.

**Wall time.**  ``compile`` over every pp x dp of the GPU count, in a fresh process (so the
first ``torch.export`` of the process is included), for a 12-layer GPT on 8 GPUs and a
96-layer GPT on 64 GPUs, with the time of each phase.  Targets (on the 2-core machine):
under 3 s and under 60 s.
"""

__all__ = ["baselines", "cli", "reference", "schedules", "tables", "wall", "zoo"]
