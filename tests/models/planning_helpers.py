"""Shared helpers of the multi-process tests: plan a model file with a fixed shape.

Costs are *predicted* for a named GPU (``device="h100"``), so the split is the same
on every run; costs measured on the CPU are noisy and could move stage boundaries.
"""

from __future__ import annotations

from pathlib import Path

import torch

from partitioner.modelfile import load_model_file
from partitioner.plan import Plan
from partitioner.search.planner import compile

MODELS = Path(__file__).parent
EXAMPLES = MODELS.parent.parent / "examples"


def make_plan(
    spec: str,
    directory: Path,
    *,
    pp: int,
    dp: int = 1,
    microbatches: int,
    schedule: str,
    batch: int = 8,
    capture_method: str = "auto",
) -> Plan:
    """Plan model file ``spec`` for ``pp x dp`` ranks and save it into ``directory``.

    ``capture_method`` ("auto", "export" or "symbolic_trace") is recorded in the plan,
    and the ranks capture the model the same way.
    """
    assert batch % (dp * microbatches) == 0, "the batch must split into dp x microbatches equal pieces"
    model_file = load_model_file(spec)
    torch.manual_seed(0)
    model = model_file.build()
    plan = compile(
        model,
        model_file.example_inputs(batch),
        gpus=pp * dp,
        pp=pp,
        dp=dp,
        microbatches=microbatches,
        schedule=schedule,
        device="h100",
        capture_method=capture_method,  # type: ignore[arg-type]
    )
    plan.save(directory)
    assert (plan.pp, plan.dp, plan.gpus, plan.microbatches, plan.schedule, plan.batch_size) == (
        pp, dp, pp * dp, microbatches, schedule, batch
    ), "the plan does not have the requested shape"
    assert capture_method in ("auto", plan.model.capture)
    assert len(plan.stages) == pp and all(len(s.ranks) == dp for s in plan.stages)
    return plan


def parameters_covered(plan: Plan, spec: str) -> tuple[set[str], set[str]]:
    """(every parameter name of the model, every name some stage of the plan holds)."""
    model_file = load_model_file(spec)
    torch.manual_seed(0)
    model = model_file.build()
    names = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    held = {p for s in plan.stages for p in s.parameters}
    for t in plan.tied:  # a stage holding one alias of a tied parameter holds all of them
        if held & set(t.aliases):
            held |= set(t.aliases)
    return names, held
