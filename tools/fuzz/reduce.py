"""Shrink a failing case: drop blocks, skips, inputs and extras, and simplify the layout, while it still fails.

:func:`reduce_case` is greedy delta debugging over a :class:`~tools.fuzz.grammar.Case`:
each candidate (:func:`candidates`) is one smaller valid case (a block removed, with the
references to it redirected; a skip removed; the second input, dict output, counter,
position parameter or final norm dropped; the layout's replicas, tensor parallelism,
sharding or recomputation turned off); the first that still ``fails`` is kept and the
search starts again, until no candidate fails.  ``fails`` is usually
"``run_case`` gives the same outcome and the same first words of its detail".

Example (run from the repository root; runs cases)::

    small = reduce_case(case, lambda c: run_case(c, tmp / str(n)).outcome == "mismatch")
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator

from tools.fuzz.grammar import PATTERNS, Block, Case, Layout, ModelSpec

__all__ = ["candidates", "reduce_case", "strip_patterns", "without_block"]


def without_block(spec: ModelSpec, block_id: int) -> ModelSpec:
    """``spec`` less one block; blocks that read its weight get their own, skips through it go."""
    gone = spec.block(block_id)
    blocks: list[Block] = []
    for b in spec.blocks:
        if b.id == block_id:
            continue
        if b.opt("ref", -1) == block_id:
            b = dataclasses.replace(b, opts=tuple((k, -1 if k == "ref" else v) for k, v in b.opts))
        blocks.append(b)
    skips = tuple(s for s in spec.skips if block_id not in s)
    changes: dict[str, object] = {"blocks": tuple(blocks), "skips": skips}
    if gone.kind == "aux_join" and not any(b.kind == "aux_join" for b in blocks):
        changes.update(aux="", aux_inplace=False)
    if gone.kind == "shared" and not any(b.kind == "shared" for b in blocks):
        changes["shared"] = ""
    return dataclasses.replace(spec, **changes)  # type: ignore[arg-type]


def _spec_candidates(spec: ModelSpec) -> Iterator[ModelSpec]:
    if len(spec.blocks) > 1:
        for b in spec.blocks:
            yield without_block(spec, b.id)
    for skip in spec.skips:
        yield dataclasses.replace(spec, skips=tuple(s for s in spec.skips if s != skip))
    if spec.aux == "mask":
        yield dataclasses.replace(spec, aux="", aux_inplace=False)
    if spec.aux_inplace:
        yield dataclasses.replace(spec, aux_inplace=False)
    for flag in ("dict_output", "counter", "pos_emb", "final_norm"):
        if getattr(spec, flag):
            yield dataclasses.replace(spec, **{flag: False})  # type: ignore[arg-type]
    if spec.head in ("alias", "functional", "matmul"):
        yield dataclasses.replace(spec, head="untied")
    if spec.width > 8:
        yield dataclasses.replace(spec, width=8)


def _layout_candidates(layout: Layout) -> Iterator[Layout]:
    if layout.dp > 1:
        yield dataclasses.replace(layout, dp=1, shard="none")
    if layout.tp > 1:
        yield dataclasses.replace(layout, tp=1)
    if layout.shard != "none":
        yield dataclasses.replace(layout, shard="none")
    if layout.recompute != "none":
        yield dataclasses.replace(layout, recompute="none")
    if layout.pp > 2:
        yield dataclasses.replace(layout, pp=2)
    if layout.schedule in ("auto", "interleaved-1f1b", "zbv", "zb-h1", "1f1b"):
        yield dataclasses.replace(layout, schedule="gpipe")
    if layout.microbatches == "auto" or (isinstance(layout.microbatches, int) and layout.microbatches > 2):
        yield dataclasses.replace(layout, microbatches=2)


def candidates(case: Case) -> Iterator[Case]:
    """Every one-step-smaller case, model first, then layout."""
    for spec in _spec_candidates(case.spec):
        yield dataclasses.replace(case, spec=spec)
    for layout in _layout_candidates(case.layout):
        yield dataclasses.replace(case, layout=layout)


def reduce_case(case: Case, fails: Callable[[Case], bool], *, budget: int = 80,
                progress: Callable[[str], None] | None = None) -> Case:
    """The smallest case reached greedily from ``case`` for which ``fails`` holds (at most ``budget`` runs)."""
    say = progress or (lambda _msg: None)
    runs = 0
    changed = True
    while changed and runs < budget:
        changed = False
        for smaller in candidates(case):
            if runs >= budget:
                break
            runs += 1
            if fails(smaller):
                case = smaller
                changed = True
                say(f"reduce: {len(case.spec.blocks)} blocks, {case.layout.label()}")
                break
    return case


def _unref(block: Block) -> Block:
    return dataclasses.replace(block, opts=tuple((k, -1 if k == "ref" else v) for k, v in block.opts))


def strip_patterns(spec: ModelSpec, names: Iterable[str]) -> ModelSpec:
    """``spec`` without the named :data:`~tools.fuzz.grammar.PATTERNS` where that is a local rewrite.

    For fuzzing around a known bug (``tools/fuzz_models.py --exclude``): ``inplace_input``
    (the input is no longer written), ``counter_buffer``, ``buffer_update`` (EMA blocks and the
    counter; BatchNorm stays), ``tied_alias`` (each tied block gets its own weight), and for
    ``functional_weight`` / ``matmul_weight`` / ``tied_alias`` the LM head becomes an untied
    linear; ``reused_module``: the shared module's blocks go; any other pattern: the blocks of
    that kind go (a model left without blocks gets a plain one).
    """
    wanted = set(names)
    unknown = wanted - set(PATTERNS)
    if unknown:
        raise ValueError(f"unknown patterns {sorted(unknown)}; choose from {', '.join(PATTERNS)}")
    if "inplace_input" in wanted:
        spec = dataclasses.replace(spec, aux_inplace=False)
    if wanted & {"counter_buffer", "buffer_update"}:
        spec = dataclasses.replace(spec, counter=False)
    if "tied_alias" in wanted:
        spec = dataclasses.replace(spec, blocks=tuple(_unref(b) if b.kind == "tied" else b for b in spec.blocks))
    heads = {"functional_weight": "functional", "matmul_weight": "matmul", "tied_alias": "alias"}
    if any(spec.head == heads[p] for p in wanted if p in heads):
        spec = dataclasses.replace(spec, head="untied")
    kinds = {"buffer_update": {"ema"}, "reused_module": {"shared"}, "scale_buffer": {"scale"},
             "functional_weight": {"fweight"}, "matmul_weight": {"matmul"},
             "several_inputs": {"aux_join"}, **{k: {k} for k in ("linear", "mlp", "layernorm", "attention",
                                                                  "fused_qkv", "dropout")},
             "inplace_op": {"inplace"}, "inplace_view": {"inplace"}}
    drop = set().union(*(kinds.get(p, set()) for p in wanted))
    for b in [b for b in spec.blocks if b.kind in drop]:
        if len(spec.blocks) == 1:  # a model keeps one block: a plain one in its place
            plain = Block(max(x.id for x in spec.blocks) + 1, "layernorm" if spec.family == "seq" else "convbn",
                          (("relu_inplace", False),) if spec.family == "conv" else ())
            spec = dataclasses.replace(spec, blocks=(*spec.blocks, plain))
        spec = without_block(spec, b.id)
    if "several_inputs" in wanted:
        spec = dataclasses.replace(spec, aux="", aux_inplace=False)
    for p, flag in (("skip", "skips"), ("dict_output", "dict_output"), ("position_parameter", "pos_emb")):
        if p in wanted:
            spec = dataclasses.replace(spec, **{flag: () if flag == "skips" else False})  # type: ignore[arg-type]
    return spec
