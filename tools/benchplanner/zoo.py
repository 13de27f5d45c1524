"""The benchmarked models (GPTs from ``examples/gpt.py``) and the planner's problem for each.

:func:`build_problem` builds the :class:`~partitioner.solve.problem.PartitionProblem` as
``compile`` does at dp = 1 and maps every solver block onto a layer unit (the
``wte``+``wpe`` embeddings, each ``blocks.i``, the ``ln_f``+``lm_head`` head), the
granularity the baselines split at.

>>> unit_of_path("blocks.2.attn", n_layer=4), unit_of_path("lm_head", n_layer=4)
(3, 5)
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable
from typing import Any

__all__ = [
    "DEVICE",
    "FULL_MODELS",
    "FULL_STAGES",
    "MICROBATCHES",
    "QUICK_MODELS",
    "QUICK_STAGES",
    "WALL_MODELS",
    "Built",
    "ModelSpec",
    "build_problem",
    "unit_of_path",
]

DEVICE = "h100"
MICROBATCHES = 8


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    name: str
    vocab: int
    n_embd: int
    n_layer: int
    seq: int
    n_head: int = 4

    def config(self) -> Any:
        from examples.gpt import GPTConfig

        return GPTConfig(
            vocab_size=self.vocab,
            block_size=self.seq,
            n_layer=self.n_layer,
            n_head=self.n_head,
            n_embd=self.n_embd,
        )

    def build(self) -> Any:
        from examples.gpt import build_model

        return build_model(self.config())

    def inputs(self, batch: int) -> tuple[Any, ...]:
        import torch

        g = torch.Generator().manual_seed(0)
        return (torch.randint(0, self.vocab, (batch, self.seq), generator=g),)

    def describe(self) -> str:
        return f"{self.n_layer}L E{self.n_embd} V{self.vocab // 1024}k T{self.seq}"


QUICK_MODELS = [ModelSpec("gpt-4L", vocab=4096, n_embd=128, n_layer=4, seq=64)]
FULL_MODELS = [
    ModelSpec("gpt-8L", vocab=16384, n_embd=256, n_layer=8, seq=256),
    ModelSpec("gpt-12L", vocab=16384, n_embd=256, n_layer=12, seq=256),
    ModelSpec("gpt-96L", vocab=16384, n_embd=64, n_layer=96, seq=64),
]
QUICK_STAGES = {"gpt-4L": (2, 4)}
FULL_STAGES = {"gpt-8L": (2, 4, 8), "gpt-12L": (2, 4, 8), "gpt-96L": (16, 64)}
WALL_MODELS = {
    (12, 8): ModelSpec("gpt-12L", vocab=16384, n_embd=256, n_layer=12, seq=256),
    (96, 64): ModelSpec("gpt-96L", vocab=16384, n_embd=64, n_layer=96, seq=64),
}


@dataclasses.dataclass
class Built:
    problem: Any
    blocks: tuple[tuple[str, ...], ...]
    unit_of_block: tuple[int, ...]
    unit_params: tuple[int, ...]
    unit_names: tuple[str, ...]


def unit_of_path(path: str, n_layer: int) -> int | None:
    """0 for the embeddings, i+1 for ``blocks.i``, n_layer+1 for the head; None for the root."""
    head = path.split(".")[0]
    if head in ("wte", "wpe"):
        return 0
    if head == "blocks":
        return int(path.split(".")[1]) + 1
    if head in ("ln_f", "lm_head"):
        return n_layer + 1
    return None


def build_problem(spec: ModelSpec, microbatches: int, say: Callable[[str], None]) -> Built:
    """The planner's problem for one micro-batch of one sample at dp = 1 (as ``compile`` builds it)."""
    from partitioner.cost.devices import DEVICES
    from partitioner.cost.nodecost import predicted_times
    from partitioner.cost.nodes import profile
    from partitioner.graph.capture import capture
    from partitioner.graph.ir import module_path
    from partitioner.graph.values import propagate_values
    from partitioner.solve.coarsen import coarsen
    from partitioner.solve.formulate import formulate, graph_costs

    model = spec.build()
    micro = spec.inputs(1)
    say(f"{spec.name}: capture + cost for the baselines")
    captured = capture(model, micro)
    propagate_values(captured.graph_module, micro)
    costs = profile(captured, micro, measure=False)
    device = DEVICES[DEVICE]
    times = {name: predicted_times(c, device) for name, c in costs.items()}
    blocks = coarsen(
        captured.graph_module, max_blocks=256, times={k: f + b for k, (f, b) in times.items()}
    )
    graph = graph_costs(captured, blocks, costs, times)
    problem = formulate(graph, dp=1, spec=device, memory_limit=float(device.memory_bytes))
    nodes = captured.nodes()
    units: list[int] = []
    for members in blocks:
        u = unit_of_path(module_path(nodes[members[0]]), spec.n_layer)
        units.append(u if u is not None else (units[-1] if units else 0))
    if any(b < a for a, b in itertools.pairwise(units)) or sorted(set(units)) != list(
        range(spec.n_layer + 2)
    ):
        raise RuntimeError(f"{spec.name}: solver blocks do not follow the layer order: {units}")
    groups = (
        [["wte", "wpe"]] + [[f"blocks.{i}"] for i in range(spec.n_layer)] + [["ln_f", "lm_head"]]
    )
    params = []
    for names in groups:
        seen: dict[int, int] = {}
        for name in names:
            for p in model.get_submodule(name).parameters():
                seen[id(p)] = p.numel()
        params.append(sum(seen.values()))
    return Built(
        problem, tuple(blocks), tuple(units), tuple(params), tuple("+".join(g) for g in groups)
    )
