"""Parallel: a rank's stages split over their tensor-parallel group, sharded and replicated.

Takes the stages with their values (:mod:`runtime.state`); splits their layers over
the tensor-parallel group as DTensors (:mod:`~runtime.parallel.tensorparallel`),
shards stage groups (:mod:`~runtime.parallel.shard`: ZeRO-1, FSDP2 units), replicates
them (:mod:`~runtime.parallel.replicate`: process groups, DDP or our bucketed reducer,
tied weights) and clips the whole model's gradients (:mod:`~runtime.parallel.clip`);
:mod:`~runtime.parallel.parallelize` holds the stage stack's parallel steps
(torchtitan's ``parallelize``: groups, ties, ``apply_tp``, ``apply_fsdp``, replicas);
:mod:`~runtime.parallel.experts` spreads each experts layer over its EP group (``ep > 1``).

May import: ``state``, ``execute`` and the planner's graph, cost, plan and base;
never ``engines`` or ``launch``.
"""

__all__: list[str] = []
