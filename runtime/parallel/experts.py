"""Expert parallelism: each replica holds a slice of every experts layer; tokens travel to their expert and back.

The plan's contract (``Plan.ep``, ``Plan.experts``; :mod:`partitioner.graph.experts`): a stage
group's ``dp`` replicas form EP groups of ``ep`` consecutive replicas (replicas
``g*ep .. (g+1)*ep - 1``); member ``j`` of a group holds experts ``[j*E/ep, (j+1)*E/ep)`` of every
layer.  :func:`apply_experts` (a step of the ``Pipeline`` recipe, right after the process groups)
rewrites each stage module: the graph nodes inlined from an experts module become one
``call_module`` into an :class:`ExpertParallel` registered at the module's own path, which holds
this member's slice of its parameters under their original names and calls a copy of the model's
own experts module (reduced to the local experts) on the token rows sent to it:

* every ``(token, k)`` pair goes to the member holding its expert (``all_to_all_single``: counts,
  then rows and local expert ids; uneven splits, no token is dropped);
* that member runs its local experts with ``index = local id (M, 1)`` and ``weights = 1``;
* the outputs come back the same way and the sender adds ``weight * output`` into its token's row.

The row transfers are torch's autograd all-to-all (:func:`all_to_all_single_autograd`): the
backward sends each output's gradient to its expert's member and each input row's back.

Gradients (:class:`ExpertsLayer`): an expert parameter's gradient already sums its EP group's
tokens, so it is summed over the expert-data-parallel group (replicas ``j, j+ep, j+2ep, ...``)
and divided by ``dp``; the replicas' DDP / reducer / broadcast leave expert parameters alone
(:func:`expert_parameters`).  :meth:`ExpertsLayer.gather` gives whole tensors in the original
names (all-gathered over the EP group) for state dicts and verification;
:meth:`ExpertsLayer.for_checkpoint` gives checkpoints each stacked slice (parameters and their
optimizer state) as its chunk of the whole entry, so any ``ep`` resumes.

Under shard ``optimizer`` (ZeRO-1) :class:`ExpertSplitOptimizer` splits the dense parameters' state
over the stage group and steps the experts with a plain optimizer.  Under tensor parallelism the
experts are not split (expert-tensor-parallel size 1, as Megatron's default): every
tensor-parallel rank ``t`` runs the whole tokens through its own EP group (ranks ``g x tp + t``).

Example (what a rank holds)::

    >>> local_experts(8, ep=4, member=1)
    range(2, 4)
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import fx, nn
from torch.distributed._functional_collectives import all_to_all_single_autograd

from partitioner.errors import AutopartitionError
from partitioner.graph.experts import ExpertLayer
from partitioner.plan import Plan
from runtime.execute.stack import StackLayer, StageStack

__all__ = [
    "ExpertGroups",
    "ExpertParallel",
    "ExpertSplitOptimizer",
    "ExpertsLayer",
    "apply_experts",
    "expert_parameters",
    "local_experts",
    "make_expert_groups",
]


def local_experts(experts: int, *, ep: int, member: int) -> range:
    """The experts member ``member`` of an EP group of ``ep`` holds (consecutive, ``experts / ep`` of them)."""
    per = experts // ep
    return range(member * per, (member + 1) * per)


@dataclasses.dataclass(frozen=True)
class ExpertGroups:
    """This rank's EP group (``ep`` consecutive replicas) and expert-data-parallel group (replicas ``j::ep``)."""

    ep: dist.ProcessGroup
    ep_ranks: tuple[int, ...]
    member: int  # this rank's place in its EP group: which experts it holds
    edp: dist.ProcessGroup | None  # None when dp == ep: one copy of each expert per stage group
    edp_ranks: tuple[int, ...]


def make_expert_groups(plan: Plan, rank: int) -> ExpertGroups:
    """Every rank creates every EP and expert-data-parallel group, in one order (torch.distributed requires it).

    Under tensor parallelism each tensor-parallel rank ``t`` has its own groups: the ranks ``t`` of the
    replicas' groups (the layout's ``ep`` and ``edp`` axes), which exchange every token of their replicas.
    """
    layout = plan.layout
    ep_group: tuple[dist.ProcessGroup, tuple[int, ...]] | None = None
    for ranks in layout.groups("ep"):
        group = dist.new_group(list(ranks))
        if rank in ranks:
            ep_group = (group, ranks)
    edp: tuple[dist.ProcessGroup | None, tuple[int, ...]] = (None, (rank,))
    if layout.size("edp") > 1:
        for ranks in layout.groups("edp"):
            group = dist.new_group(list(ranks))
            if rank in ranks:
                edp = (group, ranks)
    assert ep_group is not None  # every rank is in one EP group
    return ExpertGroups(ep=ep_group[0], ep_ranks=ep_group[1], member=layout.coord(rank, "ep"), edp=edp[0],
                        edp_ranks=edp[1])


class ExpertParallel(nn.Module):
    """One experts layer of a stage under expert parallelism, registered at the experts module's path.

    Holds this member's slice of the layer's parameters under their original names (relative to the
    module), and a copy of the model's experts module reduced to the local experts (not registered:
    its parameters are on the meta device and replaced by the held ones at each call).

    Under tensor parallelism the experts are not split (Megatron's expert-tensor-parallel size 1): their
    parameters stay plain tensors (``keeps_whole_parameters``), the DTensor inputs are made whole
    on every tensor-parallel rank, each runs the same exchange with its own EP group (the same routed
    tokens), and the output re-enters the stage replicated.
    """

    # Tensor parallelism and FSDP2 leave these parameters alone: whole, plain, reduced by ExpertsLayer.
    keeps_whole_parameters = True

    def __init__(self, layer: ExpertLayer, template: nn.Module, names: Mapping[str, str], groups: ExpertGroups,
                 *, ep: int) -> None:
        super().__init__()
        self.layer = layer
        self.__dict__["_template"] = template  # not a submodule: no state of its own
        self._names = dict(names)  # the template's parameter name -> the held one
        self._groups = groups
        self._ep = ep
        self._local = layer.experts // ep

    def forward(self, tokens: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        from torch.distributed.tensor import DTensor, Replicate

        mesh = next((t.device_mesh for t in (tokens, index, weights) if isinstance(t, DTensor)), None)
        if mesh is None:
            return self._exchange(tokens, index, weights)
        from runtime.parallel.tensorparallel import gathered

        out = self._exchange(gathered(tokens), gathered(index), gathered(weights))
        return DTensor.from_local(out, mesh, [Replicate()] * mesh.ndim, run_check=False)

    def _exchange(self, tokens: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        n, k = index.shape
        group = self._groups.ep
        flat = index.reshape(-1).long()
        owner = torch.div(flat, self._local, rounding_mode="floor")
        order = torch.argsort(owner, stable=True)  # pairs grouped by member, token order kept within
        pair_token = torch.div(torch.arange(n * k, device=index.device), k, rounding_mode="floor")[order]
        rows = tokens[pair_token]  # (P, H): each pair's token row, in send order
        local_ids = (flat - owner * self._local)[order]
        send = torch.bincount(owner, minlength=self._ep)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=group)
        send_splits, recv_splits = send.tolist(), recv.tolist()
        got_ids = local_ids.new_empty(sum(recv_splits))
        dist.all_to_all_single(got_ids, local_ids.contiguous(), recv_splits, send_splits, group=group)
        got = all_to_all_single_autograd(rows.contiguous(), recv_splits, send_splits, group)
        ones = torch.ones(got.shape[0], 1, dtype=weights.dtype, device=weights.device)
        out = self._run(got, got_ids.unsqueeze(1), ones)
        back = all_to_all_single_autograd(out.contiguous(), send_splits, recv_splits, group)  # send order
        pair_weight = weights.reshape(-1)[order].unsqueeze(1)
        result = torch.zeros_like(tokens)
        return result.index_add(0, pair_token, (back * pair_weight).to(tokens.dtype))

    def _run(self, rows: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """The model's own experts forward on the received rows, with this member's parameters."""
        template: nn.Module = self.__dict__["_template"]
        # By attribute, not get_parameter: a split backward calls this module on plain-tensor aliases of them.
        values: dict[str, torch.Tensor] = {t: _attr(self, h) for t, h in self._names.items()}
        values.update({n: b.to(rows.device) for n, b in template.named_buffers()})
        out = torch.func.functional_call(template, values, (rows, index, weights))
        assert isinstance(out, torch.Tensor)
        return out

    def local_names(self) -> list[str]:
        """This member's parameter names (relative), in local expert order."""
        return [self._names[t] for t in sorted(self._names, key=_natural)]


class ExpertsLayer(StackLayer):
    """Expert gradients: summed over the expert-data-parallel group and divided by ``dp``; whole tensors on demand."""

    def __init__(self, wrappers: Sequence[tuple[str, ExpertParallel]], groups: ExpertGroups, *, dp: int,
                 ep: int) -> None:
        self.wrappers = list(wrappers)  # (path in its stage module, wrapper)
        self.groups = groups
        self._dp = dp
        self._ep = ep
        self.parameters = [p for _, w in self.wrappers for p in w.parameters()]
        self._ep_mesh: Any = None  # the EP group as a DeviceMesh (checkpoints' chunks), made on first use

    def reduce(self) -> None:
        for p in self.parameters:
            if not p.requires_grad:
                continue
            if p.grad is None:  # no token reached these experts here: a zero share, so every member sums alike
                p.grad = torch.zeros_like(p)
            if self.groups.edp is not None:
                dist.all_reduce(p.grad, group=self.groups.edp)
            p.grad.div_(self._dp)

    def gather(self, values: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``values`` (this rank's, original names) with every expert slice replaced by the whole tensor.

        Collective over the EP group: every member calls it with the same kinds of entries.
        """
        out = dict(values)
        for path, wrapper in self.wrappers:
            layer = wrapper.layer
            for rel in wrapper.local_names():
                name = f"{path}.{rel}"
                if name not in values:
                    continue
                value = values[name].detach()
                if layer.layout == "stacked" and (value.dim() < 1 or value.shape[0] != self._per_member(layer)):
                    continue  # not per expert (e.g. an optimizer's step count): equal on every member
                parts = [torch.empty_like(value) for _ in range(self._ep)]
                dist.all_gather(parts, value.contiguous(), group=self.groups.ep)
                if layer.layout == "stacked":
                    out[name] = torch.cat(parts, dim=0)
                    continue
                del out[name]
                per = layer.experts // self._ep
                position = _entry(rel) - _span(layer, self._ep, self.groups.member)[0]
                for member, part in enumerate(parts):
                    out[f"{path}.{_renumber(rel, member * per + position)}"] = part
        return out

    def for_checkpoint(self, values: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``values`` (this rank's, original names) as a checkpoint writes them, without gathering anything.

        A listed expert's tensors are whole already (each member writes its own experts); a stacked slice
        becomes a ``DTensor`` sharded on dim 0 over the EP group, so DCP records it as its chunk of the
        whole tensor (copies from other EP groups hold the same chunks: DCP keeps one of each).  Entries
        that are not per expert (an optimizer's step count) stay as they are.
        """
        from torch.distributed.tensor import DTensor, Shard

        out = dict(values)
        for path, wrapper in self.wrappers:
            layer = wrapper.layer
            if layer.layout != "stacked":
                continue
            for rel in wrapper.local_names():
                name = f"{path}.{rel}"
                value = out.get(name)
                if value is None or value.dim() < 1 or value.shape[0] != self._per_member(layer):
                    continue
                shape, stride = (layer.experts, *value.shape[1:]), _contiguous_stride((layer.experts, *value.shape[1:]))
                out[name] = DTensor.from_local(value.detach().contiguous(), self._mesh(value.device), [Shard(0)],
                                               run_check=False, shape=torch.Size(shape), stride=stride)
        return out

    def _mesh(self, device: torch.device) -> Any:
        if self._ep_mesh is None:
            from torch.distributed.device_mesh import DeviceMesh

            self._ep_mesh = DeviceMesh.from_group(self.groups.ep, device.type)
        return self._ep_mesh

    def _per_member(self, layer: ExpertLayer) -> int:
        return layer.experts // self._ep

    def stacked_spans(self) -> dict[str, tuple[int, int, int]]:
        """Each stacked expert parameter this rank holds (original name) -> (first, end, experts) on dim 0.

        A listed layer's parameters are whole tensors already (one per expert, original names).
        """
        out: dict[str, tuple[int, int, int]] = {}
        for path, wrapper in self.wrappers:
            layer = wrapper.layer
            if layer.layout != "stacked":
                continue
            start, stop = _span(layer, self._ep, self.groups.member)
            for rel in wrapper.local_names():
                out[f"{path}.{rel}"] = (start, stop, layer.experts)
        return out

    def local(self, values: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Whole tensors (original names) -> this member's slices, as its stage modules hold them."""
        out = dict(values)
        for path, wrapper in self.wrappers:
            layer = wrapper.layer
            held = range(*_span(layer, self._ep, self.groups.member))
            for name in list(out):
                if not name.startswith(path + "."):
                    continue
                if layer.layout == "stacked":
                    if out[name].dim() >= 1 and out[name].shape[0] == layer.experts:
                        out[name] = out[name][held.start:held.stop]
                elif _entry(name[len(path) + 1:]) not in held:
                    del out[name]
        return out


class ExpertSplitOptimizer(torch.optim.Optimizer):
    """ZeRO-1 under expert parallelism: the dense parameters' optimizer (state split over the stage group) and
    the experts' own plain one, stepped together.

    The replicas' ZeRO-1 steps each dense parameter on one replica and broadcasts it; an expert slice differs
    from member to member, so it cannot be broadcast from one: every rank steps its own experts (their
    gradients are already summed over the expert-data-parallel group, so copies step alike).
    ``param_groups`` are the dense optimizer's then the experts' (the same dicts: a scheduler's changes
    reach both); ``load_state_dict`` takes that order's indices.
    """

    def __init__(self, dense: torch.optim.Optimizer, experts: torch.optim.Optimizer) -> None:
        # Not Optimizer.__init__: the parts hold the parameters, groups and state.
        self.parts = (dense, experts)
        self.defaults = dense.defaults
        self.param_groups = [*dense.param_groups, *experts.param_groups]
        self._optimizer_step_pre_hooks: dict[int, Any] = {}
        self._optimizer_step_post_hooks: dict[int, Any] = {}

    @property
    def state(self) -> dict[torch.Tensor, Any]:  # type: ignore[override]
        """Every parameter's state this rank keeps (the dense ones' share, its experts')."""
        out: dict[torch.Tensor, Any] = {}
        for part in self.parts:
            inner = getattr(part, "optim", part)  # ZeRO-1 keeps this replica's share in its wrapped optimizer
            out.update(inner.state)
        return out

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        loss = self.parts[0].step(closure)
        self.parts[1].step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for part in self.parts:
            part.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        raise NotImplementedError(
            "ExpertSplitOptimizer has no state_dict: save it with pipe.save_checkpoint(dir, optimizer=opt) "
            "(every parameter's state in original names, experts whole).")

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        dense, experts = self.parts
        count = len(dense.param_groups)
        parts: list[dict[str, Any]] = []
        first = 0
        for groups in (state_dict["param_groups"][:count], state_dict["param_groups"][count:]):
            indices = [i for g in groups for i in g["params"]]
            renumber = {i: n for n, i in enumerate(indices)}
            parts.append({
                "state": {renumber[i]: v for i, v in state_dict["state"].items() if i in renumber},
                "param_groups": [{**g, "params": [renumber[i] for i in g["params"]]} for g in groups],
            })
            first += len(indices)
        dense.load_state_dict(parts[0])
        experts.load_state_dict(parts[1])


def expert_parameters(stack: StageStack) -> set[int]:
    """ids of the expert parameters this rank holds (none without expert parallelism): the replicas' averaging
    and broadcast leave them to :class:`ExpertsLayer`."""
    found = next((layer for layer in stack.layers if isinstance(layer, ExpertsLayer)), None)
    return set() if found is None else {id(p) for p in found.parameters}


def apply_experts(stack: StageStack, model: nn.Module) -> StageStack:
    """ep > 1 (collective: every rank): the EP groups, and each stage's experts layers swapped for this member's
    :class:`ExpertParallel`; expert parameters start equal over their expert-data-parallel group."""
    plan = stack.plan
    if plan.ep == 1:
        return stack
    groups = make_expert_groups(plan, stack.rank)
    wrappers: list[tuple[str, ExpertParallel]] = []
    for local in stack.stages:
        for layer in plan.experts:
            wrapper = _swap_layer(local.module, layer, model, groups, ep=plan.ep, stage=local.plan.index)
            if wrapper is not None:
                wrappers.append((layer.module, wrapper))
    layer_ = ExpertsLayer(wrappers, groups, dp=plan.dp, ep=plan.ep)
    if groups.edp is not None:
        with torch.no_grad():
            for p in layer_.parameters:
                dist.broadcast(p.data, src=groups.edp_ranks[0], group=groups.edp)
    return stack.with_layer(layer_)


# ------------------------------------------------------------------ helpers


def _span(layer: ExpertLayer, ep: int, member: int) -> tuple[int, int]:
    held = local_experts(layer.experts, ep=ep, member=member)
    return held.start, held.stop


def _swap_layer(gm: fx.GraphModule, layer: ExpertLayer, model: nn.Module, groups: ExpertGroups, *, ep: int,
                stage: int) -> ExpertParallel | None:
    """Replace ``layer``'s nodes in ``gm`` by one call of its :class:`ExpertParallel` (None: ``gm`` runs none)."""
    graph = gm.graph
    nodes = {n.name: n for n in graph.nodes}
    inside = [nodes[n] for n in layer.nodes if n in nodes]
    if not inside:
        return None
    if len(inside) != len(layer.nodes):
        raise AutopartitionError(
            f"The experts layer {layer.module} is split across stages (stage {stage} runs {len(inside)} of its "
            f"{len(layer.nodes)} nodes): expert parallelism needs each experts layer whole in one stage. Plan "
            "again with stage boundaries outside the experts modules, or with ep 1."
        )

    def feed(name: str) -> fx.Node:
        found = nodes.get(name) or nodes.get(f"recv_{name}")
        if found is None:
            raise AutopartitionError(
                f"Stage {stage} runs the experts layer {layer.module} but neither computes nor receives its "
                f"input {name!r}: the plan does not match the model. Plan it again."
            )
        return found

    feeds = [feed(layer.tokens), feed(layer.index), feed(layer.weights)]
    output = nodes[layer.output]
    inside_set = set(inside)
    order = {n: i for i, n in enumerate(graph.nodes)}
    last = max(order[f] for f in feeds)
    after = next((n for n in graph.nodes if order[n] > last and n.op != "placeholder"), None)
    assert after is not None  # the graph's output node at least
    with graph.inserting_before(after):
        call = graph.call_module(layer.module, tuple(feeds))
    output.replace_all_uses_with(call)
    for node in reversed(inside):
        outside = [u for u in node.users if u not in inside_set]
        if outside:
            raise AutopartitionError(
                f"The experts layer {layer.module}: its node {node.name} is read by {outside[0].name} outside "
                "it. Plan it with ep 1."
            )
        graph.erase_node(node)
    for node in list(graph.nodes):  # parameters only the layer read
        if node.op == "get_attr" and not node.users and _under(str(node.target), layer.module):
            graph.erase_node(node)
    wrapper = _wrapper(gm, layer, model, groups, ep=ep)
    gm.set_submodule(layer.module, wrapper)
    graph.lint()
    gm.recompile()
    return wrapper


def _wrapper(gm: fx.GraphModule, layer: ExpertLayer, model: nn.Module, groups: ExpertGroups, *,
             ep: int) -> ExpertParallel:
    """This member's slice of the stage's own values of ``layer`` (names kept), and the reduced template."""
    holder = gm.get_submodule(layer.module)
    start, stop = _span(layer, ep, groups.member)
    original = model.get_submodule(layer.module)
    # The template shares no storage with the model: its parameters are empty meta tensors.
    memo: dict[int, object] = {id(p): nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
                               for p in original.parameters()}
    template = copy.deepcopy(original, memo)
    names: dict[str, str] = {}
    if layer.layout == "stacked":
        for name, p in list(holder.named_parameters(recurse=False)):
            if p.dim() < 1 or p.shape[0] != layer.experts:
                raise AutopartitionError(
                    f"{layer.module}.{name} has shape {tuple(p.shape)}, not {layer.experts} experts on dim 0: "
                    "its experts cannot be split. Plan it with ep 1."
                )
            holder.register_parameter(
                name, nn.Parameter(p.data[start:stop].clone(), requires_grad=p.requires_grad))
        names = {n: n for n, _ in template.named_parameters()}
    else:
        child = next(n for n, c in template.named_children() if isinstance(c, nn.ModuleList))
        entries = list(getattr(template, child))
        setattr(template, child, nn.ModuleList(entries[start:stop]))
        container = holder.get_submodule(child)
        for key in list(container._modules):
            if not start <= int(key) < stop:
                del container._modules[key]
        names = {n: _renumber(n, start + _entry(n)) if n.startswith(child + ".") else n
                 for n, _ in template.named_parameters()}
    for attr, value in list(vars(template).items()):  # e.g. num_experts: the local count now
        if isinstance(value, int) and not isinstance(value, bool) and value == layer.experts and "expert" in attr:
            setattr(template, attr, stop - start)
    wrapper = ExpertParallel(layer, template, names, groups, ep=ep)
    for name, p in holder.named_parameters(recurse=False):
        wrapper.register_parameter(name, p)
    for name, b in holder.named_buffers(recurse=False):
        wrapper.register_buffer(name, b)
    for name, c in holder.named_children():
        wrapper.add_module(name, c)
    held = dict(wrapper.named_parameters())
    missing = [h for h in names.values() if h not in held]
    if missing:
        raise AutopartitionError(
            f"The stage holds no {layer.module}.{missing[0]} (the experts module's own parameter names differ "
            "from the captured graph's). Plan it with ep 1."
        )
    return wrapper


def _attr(module: nn.Module, name: str) -> torch.Tensor:
    owner, _, leaf = name.rpartition(".")
    value = getattr(module.get_submodule(owner) if owner else module, leaf)
    assert isinstance(value, torch.Tensor)
    return value


def _under(target: str, module: str) -> bool:
    return target == module or target.startswith(module + ".")


def _entry(rel: str) -> int:
    """The expert of a listed parameter's relative name (``experts.3.w1.weight`` -> 3)."""
    return int(rel.split(".")[1])


def _renumber(rel: str, entry: int) -> str:
    parts = rel.split(".")
    parts[1] = str(entry)
    return ".".join(parts)


def _contiguous_stride(shape: Sequence[int]) -> tuple[int, ...]:
    stride, step = [], 1
    for size in reversed(shape):
        stride.append(step)
        step *= size
    return tuple(reversed(stride))


def _natural(name: str) -> tuple[object, ...]:
    return tuple(int(p) if p.isdigit() else p for p in name.split("."))

