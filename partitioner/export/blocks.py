"""A plan's stages as whole top-level blocks, the unit every framework's pipeline split keeps whole.

The planner may cut between any two ops, inside a transformer layer too;
torchtitan splits at named blocks (``tok_embeddings``, ``layers.N``, ...) and
Megatron at decoder layers.  :func:`split_blocks` gives every block with
parameters to exactly one stage, in model order, each stage one contiguous
non-empty run, so that each stage's parameter count stays as close to the
plan's as whole blocks allow: it minimises the largest relative difference
over the stages (then the parameters moved).  A block the plan cuts moves whole
to one side; :attr:`BlockSplit.deviation` says by how much each stage then
differs from the plan, and :meth:`BlockSplit.note` says it in words.

Parameters are weighted by their element counts (``sizes``, from the model:
:mod:`partitioner.export.sizes`); without them every parameter tensor counts
one, which can put stages tens of percent off, and the note says so.

Example::

    >>> from partitioner.plan import example_plan
    >>> split = split_blocks(example_plan(), sizes={"0.weight": 16, "2.weight": 16})
    >>> split.parts(), split.deviation
    ([['0'], ['2']], (0.0, 0.0))
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from partitioner.errors import AutopartitionError, InternalError
from partitioner.plan import Plan
from partitioner.units import format_count, plural

__all__ = [
    "BlockSplit",
    "block_of",
    "held_parameters",
    "layer_index",
    "split_blocks",
]


@dataclasses.dataclass(frozen=True)
class BlockSplit:
    """Whole blocks per stage, and how far each stage's parameters move from the plan's.

    ``blocks``: every block with parameters, in model order; ``stage_of``: the
    stage each goes to; ``planned`` / ``placed``: each stage's weight (parameter
    elements, or tensors when ``by_tensors``) in the plan / with whole blocks;
    ``cut``: block -> {stage: weight} for the blocks the plan splits.
    """

    blocks: tuple[str, ...]
    stage_of: tuple[int, ...]
    planned: tuple[float, ...]
    placed: tuple[float, ...]
    cut: Mapping[str, Mapping[int, float]]
    by_tensors: bool

    def parts(self) -> list[list[str]]:
        """Each stage's blocks, in model order."""
        parts: list[list[str]] = [[] for _ in self.planned]
        for block, stage in zip(self.blocks, self.stage_of):
            parts[stage].append(block)
        return parts

    @property
    def deviation(self) -> tuple[float, ...]:
        """Each stage's weight with whole blocks over the plan's, minus 1 (0.04: 4 % more)."""
        mean = sum(self.planned) / max(1, len(self.planned))
        return tuple(p / (q or mean) - 1 for p, q in zip(self.placed, self.planned))

    def note(self, framework: str, *, names: Mapping[str, str] | None = None) -> str | None:
        """What moving the cut blocks whole does to the stages, for ``framework`` (None: the plan cuts none)."""
        shown = dict(names or {})
        unit = "parameter tensors" if self.by_tensors else "parameters"
        if not self.cut:
            return None
        where = []
        for block, shares in self.cut.items():
            stage = self.stage_of[self.blocks.index(block)]
            split = " + ".join(f"{_amount(w, self.by_tensors)} in {s}" for s, w in sorted(shares.items()))
            where.append(f"{shown.get(block, block)} ({split}) -> stage {stage}")
        moved = ", ".join(f"{s} {d:+.1%}" for s, d in enumerate(self.deviation) if abs(d) >= 0.0005)
        largest = max((abs(d) for d in self.deviation), default=0.0)
        return (f"the plan cuts inside {plural(len(self.cut), 'block')}, and {framework} keeps blocks whole: each "
                f"goes whole to the stage that keeps the stages' {unit} nearest the plan's ({'; '.join(where)}). "
                f"Stage {unit} then differ from the plan's by: {moved or 'under 0.05%'} (largest {largest:.1%}); "
                "those stages' time and memory differ from the plan's prediction accordingly.")


def held_parameters(plan: Plan) -> list[list[str]]:
    """Each stage's parameter names, a tied tensor's alias given to each stage that holds it, in order."""
    held = [list(stage.parameters) for stage in plan.stages]
    for tied in plan.tied:
        names = (tied.name, *[a for a in tied.aliases if a != tied.name])
        holders = sorted(tied.stages)
        for stage in holders:
            if tied.name in held[stage]:
                held[stage].remove(tied.name)
        # The k-th holder (pipeline order) uses the k-th name (graph order): an embedding first, its tied head last.
        for k, stage in enumerate(holders):
            held[stage].append(names[min(k, len(names) - 1)])
    return held


def block_of(parameter: str) -> str:
    """The top-level block a parameter belongs to: its module path, cut after the first index.

    >>> block_of("model.layers.3.self_attn.q_proj.weight"), block_of("model.norm.weight"), block_of("lm_head.weight")
    ('model.layers.3', 'model.norm', 'lm_head')
    """
    path = parameter.split(".")[:-1]
    for i, part in enumerate(path):
        if part.isdigit():
            return ".".join(path[: i + 1])
    return ".".join(path) or parameter


def layer_index(block: str) -> int | None:
    """The layer number of a numbered block (``model.layers.3`` -> 3, ``transformer.h.0`` -> 0), else None."""
    last = block.rsplit(".", 1)[-1]
    return int(last) if last.isdigit() and "." in block else None


def split_blocks(plan: Plan, *, sizes: Mapping[str, int] | None = None, framework: str = "the framework",
                 ) -> BlockSplit:
    """Every block with parameters on one stage, stages keeping their parameter counts as near the plan's as whole
    blocks allow (see the module docstring).

    ``sizes``: parameter name -> elements (aliases of a tied tensor included);
    None: every tensor counts one.  ``framework`` names the target in errors.
    """
    held = held_parameters(plan)
    if sizes is not None:
        missing = sorted({name for names in held for name in names if name not in sizes})
        if missing:
            shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
            raise AutopartitionError(
                f"The model's parameter sizes lack {plural(len(missing), 'parameter')} the plan holds ({shown}): the "
                "model changed since it was planned. Plan it again, or export from the model the plan was made for.")
    order: dict[str, tuple[int, int]] = {}  # block -> (first stage holding it, position in that stage's graph)
    weights: dict[str, dict[int, float]] = {}  # block -> stage -> weight of its parameters there
    for plan_stage in plan.stages:
        position = {node: i for i, node in enumerate(plan_stage.nodes)}
        for name in held[plan_stage.index]:
            block = block_of(name)
            share = weights.setdefault(block, {})
            share[plan_stage.index] = share.get(plan_stage.index, 0.0) + (1.0 if sizes is None else float(sizes[name]))
            node = name.replace(".", "_")  # fx's name for a parameter; torch.export's adds "p_"
            seen = (plan_stage.index, position.get(node, position.get(f"p_{node}", len(position))))
            order[block] = min(order.get(block, seen), seen)
    blocks = sorted(order, key=lambda b: (order[b], _natural(b)))
    n_stages = len(plan.stages)
    if len(blocks) < n_stages:
        raise AutopartitionError(
            f"{framework} keeps whole blocks in each stage, and this plan has {n_stages} stages over "
            f"{plural(len(blocks), 'block')} with parameters ({', '.join(blocks)}): it cannot give every stage a "
            "block. Plan with fewer stages (fewer --chunks, or a smaller --pp) and export that plan.")
    planned = [sum(weights[b].get(s, 0.0) for b in blocks) for s in range(n_stages)]
    stage_of = _nearest_split([weights[b] for b in blocks], planned)
    placed = [0.0] * n_stages
    for block, where in zip(blocks, stage_of):
        placed[where] += sum(weights[block].values())
    cut = {b: dict(weights[b]) for b, s in zip(blocks, stage_of) if set(weights[b]) != {s}}
    return BlockSplit(tuple(blocks), tuple(stage_of), tuple(planned), tuple(placed), cut, sizes is None)


# ------------------------------------------------------------------ helpers


def _amount(weight: float, by_tensors: bool) -> str:
    return plural(int(weight), "tensor") if by_tensors else format_count(int(weight))


def _natural(name: str) -> list[tuple[int, int, str]]:
    return [(0, int(p), "") if p.isdigit() else (1, 0, p) for p in name.split(".")]


def _nearest_split(weights: Sequence[Mapping[int, float]], planned: Sequence[float]) -> list[int]:
    """A stage per block, in order, each stage one contiguous non-empty run, stage weights nearest ``planned``.

    Minimises (largest relative difference of a stage's weight from its planned
    weight, weight moved off the stage the plan put it on), exactly: dynamic
    programming over (stages so far, blocks so far), O(stages x blocks^2).

    >>> _nearest_split([{0: 3}, {0: 1, 1: 4}, {1: 2}], [4, 6])
    [0, 1, 1]
    >>> _nearest_split([{0: 10}, {0: 1, 1: 1}, {1: 10}], [11, 11])  # a tie: the block goes where the plan began it
    [0, 0, 1]
    """
    n, stages = len(weights), len(planned)
    total = [sum(w.values()) for w in weights]
    mean = sum(total) / stages
    prefix = [0.0]
    for t in total:
        prefix.append(prefix[-1] + t)
    # kept[s][i]: weight of blocks 0..i-1 that stage s holds in the plan (prefix sums per stage)
    kept = [[0.0] * (n + 1) for _ in range(stages)]
    for s in range(stages):
        for i, w in enumerate(weights):
            kept[s][i + 1] = kept[s][i] + w.get(s, 0.0)
    inf = (float("inf"), float("inf"))
    # best[s][i]: (largest relative difference, weight moved) with stages 0..s-1 holding blocks 0..i-1
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    came = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = (0.0, 0.0)
    for s in range(1, stages + 1):
        # Stage s - 1 holds blocks j..i-1: at least one, leaving one per later stage.
        for i in range(s, n - (stages - s) + 1):
            for j in range(s - 1, i):
                before = best[s - 1][j]
                if before == inf:
                    continue
                weight = prefix[i] - prefix[j]
                difference = abs(weight - planned[s - 1]) / (planned[s - 1] or mean)
                moved = weight - (kept[s - 1][i] - kept[s - 1][j])
                # Ties (equal max difference) favour the earlier stage: break them on moved weight, then later cuts.
                score = (max(before[0], round(difference, 12)), before[1] + moved)
                if score < best[s][i] or (score == best[s][i] and j > came[s][i]):
                    best[s][i], came[s][i] = score, j
    if best[stages][n] == inf:
        raise InternalError(f"no split of {n} blocks into {stages} stages")
    stage_of = [0] * n
    i = n
    for s in range(stages, 0, -1):
        j = came[s][i]
        stage_of[j:i] = [s - 1] * (i - j)
        i = j
    return stage_of
