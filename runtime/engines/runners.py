"""The stage stack's last step: what runs a step's schedule over it, our engine or torch's.

Ours, :class:`~runtime.execute.runner.StepRunner`, drives what the replication step
left per stage (the runnables, or DDP around them) and asks the layers (the stack's
hooks) around each forward and backward and when a stage's gradients are complete
(:class:`~runtime.execute.stack.StackLayer`: DDP's sync, the explicit reducer's start).  Torch's, :class:`~runtime.engines.torch_engine.TorchEngine`,
takes the runnables and replicates them itself.
"""

from __future__ import annotations

from runtime.engines.torch_engine import TorchEngine
from runtime.execute.runner import StepRunner
from runtime.execute.stack import StageStack
from runtime.parallel.experts import expert_parameters
from runtime.parallel.parallelize import ShardingLayer

__all__ = ["apply_runner"]


def apply_runner(stack: StageStack) -> StageStack:
    """The stack with its runner: ``stack.engine``'s."""
    if stack.engine == "torch":
        engine = TorchEngine(stack.plan, stack.stages, stack.runnables, stack.replica_groups, loss_fn=stack.loss_fn,
                             device=stack.device, timeout=stack.timeout,
                             sharded=stack.layer(ShardingLayer).sharded is not None, skip=expert_parameters(stack))
        return stack.replace(runner=engine)
    runner = StepRunner(stack.plan, stack.stages, stack.modules, replica=stack.replica, rank=stack.rank,
                        loss_fn=stack.loss_fn, device=stack.device, timeout=stack.timeout,
                        hooks=stack)
    return stack.replace(runner=runner)
