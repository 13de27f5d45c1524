"""Rank entry point for ``tests/test_pairing.py`` (spawned; see ``rank_workers.py``).

The MLP as 2 stages x 2 replicas with ``batch="replica"``, fed from a
``DistributedSampler`` two ways: over the global rank (the DDP habit: the two
stages of one replica read different samples) and over ``pipe.dp_rank`` (right).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from rank_workers import error_of, set_rank_env
from torch.utils.data import DistributedSampler, TensorDataset

__all__ = ["SAMPLES", "dataset", "pairing_worker", "replica_batch"]

SAMPLES = 32  # the data set: 8 samples per rank with 4 ranks


def dataset() -> TensorDataset:
    """Inputs and class targets of the MLP, the same on every rank."""
    from mlp import NUM_CLASSES, WIDTH

    g = torch.Generator().manual_seed(7)
    return TensorDataset(torch.randn(SAMPLES, WIDTH, generator=g), torch.randint(0, NUM_CLASSES, (SAMPLES,), generator=g))


def replica_batch(data: TensorDataset, size: int, *, num_replicas: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``size`` samples a shuffling ``DistributedSampler(num_replicas, rank)`` gives."""
    sampler: DistributedSampler[int] = DistributedSampler(data, num_replicas=num_replicas, rank=rank, shuffle=True, seed=0)
    indices = list(sampler)[:size]
    x, y = data[indices]
    return x, y


def pairing_worker(rank: int, world: int, port: int, plan_dir: str, spec: str, out_dir: str) -> None:
    """Three steps, each from the same parameters; ``rank{R}.pt`` holds what each gave.

    ``global_all``: sampler over the global rank, every rank given inputs and target;
    ``global_needed``: the same sampler, each rank given only what it reads
    (``needs_inputs`` / ``needs_target``, None elsewhere); ``dp_all``: sampler over
    ``pipe.dp_rank``, every rank given everything.  Each: ``error`` or ``loss``
    (None off the last stage) and ``grads`` by parameter name.
    """
    from partitioner.modelfile import load_model_file
    from partitioner.plan import Plan
    from runtime.pipeline import Pipeline

    set_rank_env(rank, world, port)
    torch.set_num_threads(1)
    plan = Plan.load(plan_dir)
    model_file = load_model_file(spec)
    torch.manual_seed(0)
    pipe = Pipeline(plan, model_file.build(), model_file.loss_fn, device=torch.device("cpu"), timeout=60,
                    batch="replica")
    size = plan.batch_size // pipe.dp_size
    data = dataset()

    def step(x: torch.Tensor | None, y: torch.Tensor | None) -> dict[str, Any]:
        for p in pipe.parameters():
            p.grad = None
        losses: list[torch.Tensor | None] = []
        error = error_of(lambda: losses.append(pipe.step(None if x is None else (x,), y)))
        loss = losses[0] if losses else None
        return {"error": error, "loss": None if loss is None else float(loss),
                "grads": {n: p.grad.clone() for n, p in pipe.named_parameters() if p.grad is not None}}

    result: dict[str, Any] = {"needs_inputs": pipe.needs_inputs, "needs_target": pipe.needs_target,
                              "stage": pipe.stage, "dp_rank": pipe.dp_rank}
    x, y = replica_batch(data, size, num_replicas=world, rank=rank)  # the DDP habit: wrong here
    result["global_all"] = step(x, y)
    result["global_needed"] = step(x if pipe.needs_inputs else None, y if pipe.needs_target else None)
    x, y = replica_batch(data, size, num_replicas=pipe.dp_size, rank=pipe.dp_rank)
    result["dp_all"] = step(x, y)
    torch.save(result, Path(out_dir) / f"rank{rank}.pt")
