"""Tensor parallelism at run time: each stage's layers split over its tensor-parallel group with DTensor.

A plan with ``tp > 1`` runs ``pp x dp x tp`` ranks.  Each entry of a stage's
``ranks`` is a *group*: ``tp`` consecutive global ranks (inside one node; the
layout's ``tp`` axis), each holding a ``1 / tp`` share of the stage.  Tensor-parallel rank ``t``
of one group talks only to tensor-parallel rank ``t`` of the others: its pipeline
peers, replicas and tied copies share its ``tp`` coordinate (:class:`~partitioner.layout.Layout`).
So for each ``t`` those ranks run the plan's schedule exactly as a ``tp = 1`` job would.  A boundary tensor that is the residual stream travels as
each rank's ``1 / tp`` slice of its sequence, to its counterpart
(:func:`~runtime.execute.wire.wire_shape`: what the planner prices, and what sequence parallelism
holds anyway); anything else travels whole.

Inside a stage the split is torch's DTensor, the engine under
``parallelize_module``'s ``ColwiseParallel`` / ``RowwiseParallel`` /
``SequenceParallel``, with the same placements (Shoeybi et al.,
arXiv:1909.08053, section 3; Korthikanti et al., arXiv:2205.05198), chosen per
parameter from the roles :func:`partitioner.graph.tensorparallel.find_tensor_parallel`
found in the captured graph (:func:`parameter_placements`):

* a *column* (an MLP's up/gate projection, attention's q, k and v; GPT-2's fused
  ``c_attn``): weight and bias split by output features (``Shard(0)`` of an
  ``nn.Linear`` weight, ``Shard(1)`` of a GPT-2 ``Conv1D``'s); its input is
  all-gathered along the sequence first (:func:`replicated`, one per value);
* a *row* (the down / output projection): weight split by input features, bias
  replicated; its output, a pending sum, is reduce-scattered along the sequence
  right after it (:func:`sequence_sharded`), so norms, residuals and dropout work
  on ``1 / tp`` of the tokens;
* the token embedding split by vocabulary rows (its output reduced, then split
  along the sequence), the LM head by vocabulary columns: the loss runs on its
  split logits under torch's ``loss_parallel`` (:func:`tensor_parallel_step`);
* everything else (norms, position embeddings, key/value projections whose heads
  ``tp`` does not divide: grouped-query attention replicates them) replicated; a
  pair kept whole (``TPLayout.whole``: GPT's fused ``c_attn``) runs whole on every
  rank, what enters it all-gathered first, as the planner prices it.

``parallelize_module`` itself needs the modules to be called as local-shape
code (``use_local_output``); a captured stage is one graph whose views carry the
model's global shapes (``view(B, T, 12, 64)``), so here the graph runs on DTensors
in global semantics: parameters become DTensors, tensors the graph makes join
them as replicated (``implicit_replication``, held for the whole step by
:func:`tensor_parallel_step` so that backward sees it too), attention runs
head-parallel on each rank's heads through ``local_map`` (DTensor has no CPU
attention rule), and :class:`TensorParallelStage` turns what enters and leaves
the stage into DTensors and back.  Whatever the placements, DTensor computes the
unsplit model's numbers: a poor placement costs communication, never correctness.
Replicas of a stage planned ``full`` are FSDP2 over the ``dp`` slice of one
``(pp, dp, tp)`` mesh (:func:`tensor_parallel_meshes`), which shards the
tensor-parallel parameters once more (2-D DTensors), as torchtitan's FSDP x TP.

Dropout under ``tp > 1`` draws from DTensor's own random stream, so masks differ
from an unpartitioned run (as in Megatron); runs without dropout are equal to it.

Example (every rank of a ``tp = 2`` job, after ``init_process_group``)::

    tp_mesh, dp_mesh = tensor_parallel_meshes(plan, torch.device("cpu"))
    parallelize_stages([stage_module], tp_mesh)   # parameters now DTensors, graph rewritten
    run = TensorParallelStage(stage_module, tp_mesh, model_inputs=1, received=[], sent=0)
    with tensor_parallel_step(plan, vocabulary_parallel=True):
        loss = loss_fn(run(*inputs)[0], target)
        loss.backward()
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import Any, cast

import torch
from torch import fx, nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.experimental import implicit_replication, local_map
from torch.distributed.tensor.parallel import loss_parallel
from torch.distributed.tensor.placement_types import Placement
from torch.utils import _pytree as pytree

from partitioner.defaults import layout_refusal
from partitioner.errors import AutopartitionError
from partitioner.graph.capture import buffers_written
from partitioner.graph.ir import KIND_KEY, VALUE_KEY, node_parameters
from partitioner.graph.tensorparallel import LOCAL_KEY, TP_KEY, WHOLE_KEY, TPRole, runs_by_heads
from partitioner.plan import Plan
from runtime.execute.wire import sequence_split

__all__ = [
    "VOCABULARY_OUTPUTS",
    "LocalCall",
    "TensorParallelStage",
    "gathered",
    "has_vocabulary_head",
    "head_parallel_attention",
    "match_gradients",
    "parallelize_stages",
    "parameter_placements",
    "plain_write",
    "refuse_unrunnable_tp",
    "replicated",
    "replicated_gradients",
    "sequence_sharded",
    "tensor_parallel_loss",
    "tensor_parallel_meshes",
    "tensor_parallel_refusal",
    "tensor_parallel_step",
    "whole_call",
]



def tensor_parallel_refusal(plan: Plan, *, engine: str = "ours") -> str | None:
    """Why the runtime cannot run this tensor-parallel plan (None: it can, or ``tp == 1``)."""
    why = next((why for s in plan.stages if (why := layout_refusal(tp=plan.tp, dp=plan.dp, shard=s.shard))), None)
    if why is not None:
        return f"this plan has tp={plan.tp}: {why}; plan with --shard none or full (or --tp 1)"
    why = layout_refusal(tp=plan.tp, engine=engine)
    if why is not None:
        return f"this plan has tp={plan.tp}: {why}; run it with our engine (--engine ours), or plan with --tp 1"
    return None


def refuse_unrunnable_tp(plan: Plan, *, engine: str | None = "ours") -> None:
    """Raise :func:`tensor_parallel_refusal`'s reason, if any (``verify`` and ``run``, before starting ranks)."""
    refusal = tensor_parallel_refusal(plan, engine=engine or "ours")
    if refusal is not None:
        raise AutopartitionError(refusal)


def tensor_parallel_meshes(plan: Plan, device: torch.device) -> tuple[DeviceMesh, DeviceMesh]:
    """This rank's (tensor-parallel, replica) meshes: slices of one ``(pp, dp, tp)`` mesh, in the rank
    order ``(p x dp + r) x tp + t``, so that FSDP2 can shard tensor-parallel layers over the replicas
    (collective: every rank of the job calls it).  Fully sharded over one node's replicas (``shard_span``
    "node", HSDP) the replicas are ``(replicate, shard)``: a ``(pp, replicate, shard, tp)`` mesh."""
    full = [st for st in plan.stages if st.shard == "full"]
    layout = dataclasses.replace(plan.layout, dp_shard=plan.shard_degree(full[0]) if full else plan.dp)
    if layout.shards < plan.dp:  # HSDP: (replicate, shard) replicas, as torchtitan's dp_replicate x dp_shard x tp
        shape = layout.shape(("pp", "dp_replicate", "dp_shard", "tp"))
        mesh = init_device_mesh(device.type, shape, mesh_dim_names=("pp", "replicate", "shard", "tp"))
        return mesh["tp"], mesh["replicate", "shard"]
    mesh = init_device_mesh(device.type, layout.shape(("pp", "dp", "tp")), mesh_dim_names=("pp", "dp", "tp"))
    return mesh["tp"], mesh["dp"]


def parameter_placements(gm: fx.GraphModule, tp: int) -> dict[str, Placement]:
    """How each split parameter of ``gm`` is placed over ``tp`` ranks, from its nodes' roles (others: replicated).

    A role whose units (heads, columns, vocabulary entries) ``tp`` does not divide
    keeps its parameters whole (grouped-query attention's key/value heads).
    """
    placements: dict[str, Placement] = {}
    for node in gm.graph.nodes:
        role: TPRole | None = node.meta.get(TP_KEY)
        if role is None or role.role not in ("column", "row", "embedding", "head"):
            continue
        for name in node_parameters(gm, node):
            placement = _placement(gm, node, name, role, tp)
            if placement is not None:
                placements[name] = placement
    return placements


def _placement(gm: fx.GraphModule, node: fx.Node, name: str, role: TPRole, tp: int) -> Placement | None:
    if role.role != "embedding" and role.units % tp:
        return None
    param = gm.get_parameter(name)
    # (out, in): nn.Linear and aten.linear; (in, out): GPT-2's Conv1D and addmm/mm with a stored weight.
    out_dim = 1 if _in_out_layout(gm, node) and param.dim() == 2 else 0
    if role.role in ("column", "head"):
        return Shard(out_dim)
    if role.role == "embedding":
        return Shard(0)
    # row: the weight splits by input features; its bias is added once, after the sum
    return Shard(1 - out_dim) if param.dim() == 2 else None


def _in_out_layout(gm: fx.GraphModule, node: fx.Node) -> bool:
    if node.op == "call_module":
        return type(gm.get_submodule(str(node.target))).__name__ == "Conv1D"
    name = getattr(node.target, "__name__", str(node.target)).split(".")[0]
    if name == "fp8_linear":  # --precision fp8's rewrite (runtime.state.fp8): it says which layout it read
        return bool(node.kwargs.get("transposed"))
    return name in ("addmm", "mm", "conv1d_hf")


def parallelize_stages(modules: Sequence[fx.GraphModule], mesh: DeviceMesh) -> list[dict[str, Placement]]:
    """Split each stage module's parameters over ``mesh`` and rewrite its graph to run on DTensors.

    Parameters become ``nn.Parameter(DTensor)`` under their names, one object per
    parameter the modules share (a tied weight two stages of this rank hold);
    attention runs head-parallel, rows and embeddings are all-reduced after
    themselves, and outputs leave whole.  Call it on every rank of the group with
    equal values: ``distribute_tensor`` takes tensor-parallel rank 0's.  Returns
    each module's placements of its split parameters.
    """
    made: dict[int, nn.Parameter] = {}
    placed = []
    for gm in modules:
        placements = parameter_placements(gm, mesh.size())
        # Modules that keep their parameters whole and plain on every rank (expert parallelism's experts).
        plain = [path + "." for path, m in gm.named_modules() if getattr(m, "keeps_whole_parameters", False)]
        for name, param in list(gm.named_parameters(remove_duplicate=False)):
            if any(name.startswith(prefix) for prefix in plain):
                continue
            if id(param) not in made:
                value = distribute_tensor(param.detach(), mesh, [placements.get(name, Replicate())])
                made[id(param)] = _carrying_hooks(param, nn.Parameter(value, requires_grad=param.requires_grad))
            owner, _, attr = name.rpartition(".")
            setattr(gm.get_submodule(owner) if owner else gm, attr, made[id(param)])
        _rewrite(gm)
        placed.append(placements)
    return placed


VOCABULARY_OUTPUTS = "autopartition_vocabulary_outputs"  # gm.meta: positions of outputs that are LM-head logits


def _carrying_hooks(old: torch.Tensor, new: nn.Parameter) -> nn.Parameter:
    """``new`` with the gradient hooks the model registered on ``old`` (``param.register_hook``, post-accumulate
    hooks): the parameter it replaces.  They then see DTensor gradients (elementwise hooks work unchanged)."""
    for hook in (old._backward_hooks or {}).values():
        new.register_hook(hook)
    for hook in (getattr(old, "_post_accumulate_grad_hooks", None) or {}).values():
        new.register_post_accumulate_grad_hook(hook)
    return new


def _rewrite(gm: fx.GraphModule) -> None:
    from partitioner.graph.meetings import writes_in_place

    graph = gm.graph
    gathered_inputs: dict[fx.Node, fx.Node] = {}  # a value the columns read -> its all-gathered copy (one per value)
    _writes_on_whole_values(gm)
    output = next(n for n in graph.nodes if n.op == "output")
    results = output.args[0] if isinstance(output.args[0], (tuple, list)) else (output.args[0],)
    gm.meta[VOCABULARY_OUTPUTS] = frozenset(
        i for i, v in enumerate(results) if isinstance(v, fx.Node) and getattr(v.meta.get(TP_KEY), "role", None) == "head")
    for node in list(graph.nodes):
        if runs_by_heads(node):
            node.target = head_parallel_attention
            continue
        if node.op == "call_function" and _foreign_op(node.target):  # DTensor has no rule for it
            node.args = (_op_name(node.target), *node.args)
            node.target = whole_call
            continue
        role: TPRole | None = node.meta.get(TP_KEY)
        if role is None and node.op in ("call_function", "call_module", "call_method") and (
                node.meta.get(LOCAL_KEY) or (node.meta.get(WHOLE_KEY) and not writes_in_place(gm, node))):
            # An aten op it runs (forward or backward) has no DTensor rule, or its pair is kept whole: it runs on
            # whole local values, as the planner priced it (on sequence-split DTensors DTensor would split a whole
            # attention's matmuls by tokens and sum partials in another float32 order, and a Replicate gradient
            # may hold a non-contiguous local tensor whose strides DTensor believes contiguous).
            node.target = LocalCall(gm.get_submodule(str(node.target)) if node.op == "call_module" else node.target,
                                    method=node.op == "call_method")
            node.op = "call_function"
            continue
        if role is None:
            continue
        if role.role in ("column", "head"):  # Megatron-SP's all-gather of the sequence before the columns
            for source in [a for a in node.all_input_nodes if a.op not in ("get_attr",) and not _is_parameter(a)]:
                if source not in gathered_inputs:
                    with graph.inserting_after(source):
                        gathered_inputs[source] = graph.call_function(replicated, (source,))
                node.replace_input_with(source, gathered_inputs[source])
        elif role.role in ("row", "embedding"):  # the pending sum reduce-scattered over the sequence
            with graph.inserting_after(node):
                split = graph.call_function(sequence_sharded, (node,))
            node.replace_all_uses_with(split, delete_user_cb=lambda user, split=split: user is not split)
    graph.lint()
    gm.recompile()


def _writes_on_whole_values(gm: fx.GraphModule) -> None:
    """Rewrite in-place writes that DTensor would lose or refuse, before the split layers' rewrite.

    * A write through a view of an activation (``y[:, 0].mul_(2)``): indexing a DTensor
      split along the indexed dimension gathers a new tensor, not a view, and the write
      would never reach ``y``.  ``y`` is made replicated first (:func:`replicated`), so
      its views are views of each rank's whole local tensor.
    * A write into a buffer (a plain tensor: ``self.ema.add_(0.1 * h.mean(0))``) from
      DTensors: DTensor cannot write into a plain tensor, so the op runs on whole plain
      values (:func:`plain_write`); the buffer then holds what the unsplit model's does.
    """
    from partitioner.graph.meetings import writes_in_place

    graph = gm.graph
    made: dict[fx.Node, fx.Node] = {}  # a base written through a view -> its replicated copy
    last_write: dict[fx.Node, fx.Node] = {}  # that copy -> the last node writing it through a view
    first_op = next(n for n in graph.nodes if n.op != "placeholder")
    into_buffers = {n for n in graph.nodes if buffers_written(gm, n)}  # before rewriting any (they chain)
    for node in list(graph.nodes):
        if not writes_in_place(gm, node) or not node.args or not isinstance(node.args[0], fx.Node):
            continue
        target = node.args[0]
        base = target
        while base.op in ("call_function", "call_method") and _is_view(base) and base.args \
                and isinstance(base.args[0], fx.Node):
            base = base.args[0]
        if (base.op == "get_attr" or node in into_buffers) and node.op in ("call_function", "call_method") \
                and not node.kwargs:
            how = node.target if node.op == "call_method" else _op_name(node.target) \
                if isinstance(node.target, torch._ops.OpOverload) else None
            if isinstance(how, str):
                node.op, node.target, node.args = "call_function", plain_write, (how, *node.args)
            continue
        if base is target or base.op == "get_attr":
            continue
        if base not in made.values():
            if base not in made:
                with graph.inserting_before(first_op) if base.op == "placeholder" else graph.inserting_after(base):
                    whole = made[base] = graph.call_function(replicated, (base,))
                base.replace_all_uses_with(whole, delete_user_cb=_other_than(whole))
            base = made[base]
        last_write[base] = node
    # After the writes, the value's gradient must come back whole: autograd's backward of a write through a
    # view (CopySlices) strides into the gradient as into the whole tensor, which a split gradient is not.
    position = {n: i for i, n in enumerate(graph.nodes)}
    for whole, last in last_write.items():
        with graph.inserting_after(last):
            after = graph.call_function(replicated_gradients, (whole,))
        whole.replace_all_uses_with(after, delete_user_cb=_after_other_than(after, position, position[last]))
    graph.lint()


def _other_than(node: fx.Node) -> Callable[[fx.Node], bool]:
    return lambda user: user is not node


def _after_other_than(node: fx.Node, position: dict[fx.Node, int], start: int) -> Callable[[fx.Node], bool]:
    return lambda user: user is not node and position.get(user, -1) > start


_VIEW_NAMES = frozenset({"getitem", "__getitem__", "view", "reshape", "select", "slice", "narrow", "transpose",
                         "permute", "expand", "unsqueeze", "squeeze", "flatten", "unflatten", "t", "diagonal",
                         "as_strided", "movedim", "split", "chunk", "unbind", "view_as", "alias"})


def _is_view(node: fx.Node) -> bool:
    target = node.target
    name = target.overloadpacket.__name__ if isinstance(target, torch._ops.OpOverload) else (
        target if isinstance(target, str) else getattr(target, "__name__", ""))
    return name in _VIEW_NAMES


def plain_write(how: str, target: Any, *args: Any) -> Any:
    """``target``'s in-place op ``how`` (a method name, or an aten op ``ns::op.overload``) on whole values:
    a plain tensor (a buffer) written from DTensors.  A DTensor target is written as DTensor writes it."""
    if not isinstance(target, DTensor):
        args = tuple(_whole(a) for a in args)
    if "::" not in how:
        return getattr(target, how)(*args)
    namespace, rest = how.split("::")
    opname, overload = rest.split(".")
    return getattr(getattr(getattr(torch.ops, namespace), opname), overload)(target, *args)


def _foreign_op(target: Any) -> bool:
    """A registered op outside aten (a library's own kernel, e.g. transformers' grouped expert matmul)."""
    return isinstance(target, torch._ops.OpOverload) and target.namespace not in ("aten", "prims")


def _op_name(op: Any) -> str:
    """An op's qualified name as a graph argument (fx prints strings; ``whole_call`` looks the op up)."""
    return f"{op.namespace}::{op._opname}.{op._overloadname}"


class LocalCall:
    """A node's function or module run on whole local values: DTensor inputs gathered, a module's DTensor
    parameters read as their local (replicated) values, the result replicated; gradients flow back through
    ``to_local`` / ``from_local``.  For what DTensor has no sharding rule for (``partitioner.graph.tpops``)."""

    def __init__(self, target: Any, *, method: bool = False) -> None:
        self.target, self.method = target, method  # method: ``target`` is a method name, called on the first argument
        name = target if method else getattr(target, "__name__", type(target).__name__.lower())
        self.__name__ = f"local_{name}"  # fx names the node after it

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        inputs = [a for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, DTensor)]
        module = self.target if isinstance(self.target, nn.Module) else None
        held = {n: p for n, p in module.named_parameters() if isinstance(p, DTensor)} if module is not None else {}
        mesh = next((t.device_mesh for t in (*inputs, *held.values())), None)
        if mesh is None:
            return self.target(*args, **kwargs)
        args, kwargs = pytree.tree_map_only(DTensor, _whole, (args, kwargs))
        if module is not None:
            local = {n: p.redistribute(placements=[Replicate()] * p.device_mesh.ndim).to_local() for n, p in held.items()}
            result = torch.func.functional_call(module, local, args, kwargs, strict=False)
        elif self.method:
            result = getattr(args[0], self.target)(*args[1:], **kwargs)
        else:
            result = self.target(*args, **kwargs)
        return pytree.tree_map_only(torch.Tensor, lambda t: DTensor.from_local(t, mesh, [Replicate()] * mesh.ndim,
                                                                             run_check=False), result)


def whole_call(name: str, *args: Any, **kwargs: Any) -> Any:
    """Run the op ``name`` (``ns::op.overload``) on whole tensors of every rank: DTensor has no sharding
    rule for ops outside aten, so its inputs are gathered, it runs locally and its result is replicated."""
    namespace, rest = name.split("::")
    opname, overload = rest.split(".")
    op = getattr(getattr(getattr(torch.ops, namespace), opname), overload)
    mesh = next((a.device_mesh for a in (*args, *kwargs.values()) if isinstance(a, DTensor)), None)
    if mesh is None:
        return op(*args, **kwargs)
    result = op(*(_whole(a) for a in args), **{k: _whole(v) for k, v in kwargs.items()})
    return pytree.tree_map_only(torch.Tensor, lambda t: DTensor.from_local(t, mesh, [Replicate()], run_check=False),
                                result)


def _floating(node: fx.Node) -> bool:
    """Whether ``node`` makes a floating-point tensor (what the sequence split applies to), or may (unknown)."""
    info = node.meta.get(VALUE_KEY)
    return info is None or (info.kind == "tensor" and info.dtype.startswith(("float", "bfloat")))


def _is_parameter(node: fx.Node) -> bool:
    return node.meta.get(KIND_KEY) == "parameter"


def replicated(value: Any) -> Any:
    """``value`` replicated over its mesh (a pending sum all-reduced, a shard gathered); anything else as it is.

    Its gradient is made whole before it flows back: a column's input gradient
    is a pending sum (Megatron's ``f``), which the embedding's masked partial
    cannot take in as is.
    """
    if not isinstance(value, DTensor) or all(p.is_replicate() for p in value.placements):
        return value
    mesh = value.device_mesh
    whole = value.redistribute(mesh, [Replicate()] * mesh.ndim)
    local = whole.to_local(grad_placements=[Replicate()] * mesh.ndim)
    return DTensor.from_local(local, mesh, [Replicate()] * mesh.ndim, run_check=False)


def replicated_gradients(value: Any) -> Any:
    """``value`` (a replicated DTensor) as it is, whose gradient is made replicated before it flows back.

    A write through a view of ``value`` came before (``y[:, 0].mul_(2)``): its backward
    takes the gradient's slice by the whole tensor's strides, so the gradient must be whole.
    """
    if not isinstance(value, DTensor):
        return value
    mesh = value.device_mesh
    whole = [Replicate()] * mesh.ndim
    return DTensor.from_local(value.to_local(grad_placements=whole), mesh, whole, run_check=False)


def sequence_sharded(value: Any) -> Any:
    """``value`` split along the sequence (dimension -2) over its mesh: a pending sum reduce-scattered.

    Between a row and the next columns the residual stream, norms and dropout work
    on ``1 / tp`` of the tokens (sequence parallelism, Korthikanti et al.,
    arXiv:2205.05198, section 4.2.2).  The embedding's masked partial sum is
    all-reduced first (DTensor cannot reduce-scatter it).
    """
    if not isinstance(value, DTensor) or value.dim() < 2:
        return value
    if any(p.is_partial() and type(p).__name__ != "Partial" for p in value.placements):
        value = replicated(value)
    return value.redistribute(value.device_mesh, [Shard(value.dim() - 2)])


def head_parallel_attention(query: Any, key: Any, value: Any, *args: Any, **kwargs: Any) -> Any:
    """``scaled_dot_product_attention`` on each rank's heads (dim 1), or whole where heads are not all split alike.

    Each head attends on its own, so the op runs on local tensors under
    ``local_map``; a mask or other tensor arguments are made whole first.
    """
    op = torch.ops.aten.scaled_dot_product_attention.default
    if not isinstance(query, DTensor):
        return op(query, key, value, *args, **kwargs)
    mesh = query.device_mesh
    by_heads = all(isinstance(t, DTensor) and t.placements == (Shard(1),) for t in (query, key, value))
    placement: Sequence[Placement] = [Shard(1)] if by_heads else [Replicate()]
    rest = [_whole(a) for a in args]
    options = {k: _whole(v) for k, v in kwargs.items()}

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return op(q, k, v, *rest, **options)

    run = local_map(attend, out_placements=placement, in_placements=(placement, placement, placement),
                    device_mesh=mesh, redistribute_inputs=True)
    return run(query, key, value)


class TensorParallelStage(nn.Module):
    """Runs a stage's ``inner`` module on DTensors: tensors enter as DTensors, leave as plain tensors.

    Model inputs enter replicated; received boundary tensors (``received``: each one's
    planned whole shape and dtype, in order) as :func:`~runtime.execute.wire.sequence_split` says (this
    rank's slice of the sequence, or whole).  The first ``sent`` outputs
    leave by the same rule (what the next stage's rank receives); the others (model
    outputs: logits, a loss) leave whole.  Entering through ``DTensor.from_local``
    (autograd sees it), a received tensor's gradient leaves as a plain tensor shaped
    as it came.
    """

    def __init__(self, inner: nn.Module, mesh: DeviceMesh, *, model_inputs: int,
                 received: Sequence[tuple[Sequence[int], str]], sent: int) -> None:
        super().__init__()
        self.inner = inner
        self._mesh = mesh
        self._model_inputs = model_inputs
        tp = mesh.size()
        self._split = [sequence_split(shape, dtype, tp) for shape, dtype in received]  # whole shapes, as planned
        self._sent = sent
        # Outputs that are vocabulary-parallel logits (parallelize_stages marks them in the stage graph).
        self._vocabulary = frozenset().union(*(m.meta.get(VOCABULARY_OUTPUTS, frozenset()) for m in inner.modules()
                                               if isinstance(m, fx.GraphModule)))

    def forward(self, *args: Any) -> Any:
        entered = [self._enter(a, split=i >= self._model_inputs and self._split[i - self._model_inputs])
                   for i, a in enumerate(args)]
        outputs = self.inner(*entered)
        return tuple(self._leave(v, sent=i < self._sent, logits=i in self._vocabulary) for i, v in enumerate(outputs))

    def _enter(self, value: Any, *, split: bool) -> Any:
        if not isinstance(value, torch.Tensor) or isinstance(value, DTensor) or not value.is_floating_point():
            return value  # integer ids and masks meet DTensors as replicated (implicit_replication)
        placement = Shard(value.dim() - 2) if split else Replicate()
        return DTensor.from_local(value, self._mesh, [placement], run_check=False)

    def _leave(self, value: Any, *, sent: bool, logits: bool = False) -> Any:
        if not isinstance(value, torch.Tensor):
            return gathered(value)
        if logits and not sent and isinstance(value, DTensor) and value.placements == (Shard(value.dim() - 1),):
            return value  # vocabulary-parallel logits: the loss runs on them sharded (loss_parallel)
        if sent and sequence_split(tuple(value.shape), str(value.dtype)[6:], self._mesh.size()):
            if not isinstance(value, DTensor):
                value = DTensor.from_local(value, self._mesh, [Replicate()], run_check=False)
            return value.redistribute(self._mesh, [Shard(value.dim() - 2)]).to_local()
        return gathered(value)


def gathered(values: Any) -> Any:
    """Plain tensors, each whole on every rank of the group (a model output, or what travels whole).

    Its gradient may come back as a plain tensor or, where the loss mixed it with
    DTensors (vocabulary-parallel logits under ``loss_parallel`` plus another output),
    as a DTensor: either is taken (:class:`_Whole`).
    """
    if isinstance(values, DTensor):
        return _Whole.apply(values)
    if isinstance(values, (tuple, list)):
        return type(values)(gathered(v) for v in values)
    if isinstance(values, dict):
        return {k: gathered(v) for k, v in values.items()}
    return values


class _Whole(torch.autograd.Function):
    """A DTensor's full tensor (plain); backward takes a plain or a DTensor gradient and returns it replicated.

    ``DTensor.full_tensor``'s own backward (``to_local``'s) refuses a DTensor gradient, which a plain
    output gets back from any DTensor op it met afterwards (the loss's sum with vocabulary-parallel
    cross-entropy, under ``implicit_replication``).
    """

    @staticmethod
    def forward(ctx: Any, value: DTensor) -> torch.Tensor:  # type: ignore[override]
        ctx.mesh = value.device_mesh
        return value.full_tensor()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> DTensor:  # type: ignore[override]
        if isinstance(grad, DTensor):
            grad = grad.full_tensor()
        whole = [Replicate()] * ctx.mesh.ndim
        return DTensor.from_local(grad.contiguous(), ctx.mesh, whole, run_check=False)


def match_gradients(modules: Sequence[nn.Module]) -> None:
    """Lay every DTensor gradient out as its parameter: pending sums all-reduced, so that each rank holds
    its parameter's part of the whole gradient (what an optimizer, clipping and checkpoints expect)."""
    for module in modules:
        for param in module.parameters():
            grad = param.grad
            if isinstance(grad, DTensor) and isinstance(param, DTensor) and grad.placements != param.placements:
                param.grad = grad.redistribute(param.device_mesh, param.placements)


def _whole(value: Any) -> Any:
    return value.full_tensor() if isinstance(value, DTensor) else value


def has_vocabulary_head(modules: Sequence[fx.GraphModule]) -> bool:
    """Whether one of these stages computes vocabulary-parallel logits (an LM head split by vocabulary)."""
    return any(getattr(n.meta.get(TP_KEY), "role", None) == "head" for m in modules for n in m.graph.nodes)


def tensor_parallel_loss(loss_fn: Callable[[Any, Any], torch.Tensor] | None) -> Callable[[Any, Any], torch.Tensor] | None:
    """``loss_fn`` whose result leaves as a plain tensor (it may get vocabulary-parallel logits, computed
    under the step's ``loss_parallel``: the softmax's sums all-reduced, the logits never gathered)."""
    if loss_fn is None:
        return None
    inner = loss_fn

    def whole_loss(outputs: Any, target: Any) -> torch.Tensor:
        return cast(torch.Tensor, gathered(inner(outputs, target)))

    return whole_loss


@contextlib.contextmanager
def tensor_parallel_step(plan: Plan, *, vocabulary_parallel: bool = False) -> Iterator[None]:
    """Held around a step's forwards and backwards: plain tensors meeting DTensors count as replicated,
    and (``vocabulary_parallel``: this rank holds the LM head) cross-entropy on logits split by
    vocabulary runs as torch's ``loss_parallel`` (Megatron's vocab-parallel cross-entropy).

    DTensor's switches are process-wide (backward threads see them too); nothing
    happens with ``tp == 1``.
    """
    if plan.tp == 1:
        yield
        return
    with implicit_replication(), (loss_parallel() if vocabulary_parallel else contextlib.nullcontext()):
        yield
