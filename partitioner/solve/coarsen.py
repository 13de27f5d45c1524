"""Coarsen: group compute nodes into blocks the solver places as units.

Blocks are runs of consecutive compute nodes (in graph order) that share a
module path truncated at some depth (``blocks.3.attn``).  A run of a
topological order is always convex, so any split of the blocks is a valid split
of the nodes.  The finest depth whose run count fits ``max_blocks`` wins; runs
of a deeper module always nest inside a shallower one's, so the blocks refine
every whole-layer split.  Cuts that would separate a tuple-producing node from
its ``getitem`` readers are never offered.

Example::

    >>> import torch
    >>> from partitioner.graph.capture import capture
    >>> m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    >>> c = capture(m, (torch.randn(2, 4),))
    >>> [list(b) for b in coarsen(c.graph_module, max_blocks=8)]  # one node per leaf module
    [['_0'], ['_1'], ['_2']]
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from partitioner.graph.ir import VALUE_KEY, ValueInfo, compute_nodes, module_path

if TYPE_CHECKING:  # types only: this module imports without torch
    from torch import fx

__all__ = ["coarsen", "pinned_state"]


def coarsen(gm: fx.GraphModule, *, max_blocks: int, times: dict[str, float] | None = None,
            whole: Sequence[Iterable[str]] = ()) -> list[tuple[str, ...]]:
    """Blocks of compute-node names, in graph order, at most ``max_blocks`` of them.

    ``whole``: groups of nodes no cut may fall within (from a group's first node to its last): an experts
    layer, which expert parallelism runs as one exchange (runtime/parallel/experts.py).
    """
    nodes = compute_nodes(gm)
    if not nodes:
        return []
    position = {n.name: i for i, n in enumerate(nodes)}
    cuttable = _cuttable(gm, nodes, position)
    for group in whole:
        where = [position[name] for name in group if name in position]
        for k in range(min(where, default=0), max(where, default=0)):
            cuttable[k] = False
    paths = [module_path(n).split(".") if module_path(n) else [] for n in nodes]
    depth = max(len(p) for p in paths)
    runs: list[list[int]] = []
    for d in range(depth + 1, 0, -1):
        # d = depth + 1 means "every node on its own"; d = 1 the top-level modules.
        keys = [tuple(p[:d]) if d <= depth else (str(i),) for i, p in enumerate(paths)]
        runs = _runs(keys, cuttable)
        if len(runs) <= max_blocks:
            return [tuple(nodes[i].name for i in run) for run in runs]
    # Even top-level modules are too many: merge neighbours into even blocks, on module boundaries.
    runs = _merge_evenly(runs, max_blocks, [times.get(n.name, 1.0) if times else 1.0 for n in nodes])
    return [tuple(nodes[i].name for i in run) for run in runs]


def _cuttable(gm: fx.GraphModule, nodes: list[fx.Node], position: dict[str, int]) -> list[bool]:
    """``cuttable[k]``: a stage boundary may fall between node k and node k+1."""
    blocked_until = -1
    ok = [True] * len(nodes)
    for k, node in enumerate(nodes):
        info = node.meta.get(VALUE_KEY)
        # Tuples of tensors and values fake propagation cannot see (``x.device``) stay with their readers.
        if isinstance(info, ValueInfo) and info.kind in ("bundle", "none") and node.users:
            last = max((position[u.name] for u in node.users if u.name in position), default=k)
            blocked_until = max(blocked_until, last)
        if k < blocked_until:
            ok[k] = False
    # A write into a view of a tensor (``shifted[:, 1:] = ...``, then reads of ``shifted``) must see its base
    # in the same stage: a view sent to another stage arrives as a tensor of its own, and the write would
    # not reach the base.  No cut from the base to the last such write.  The same for a write into the
    # tensor itself that others read too (``y = fc(h); y.mul_(0.5); tanh(y)``: the op writing has no reader,
    # nothing else orders it): a stage reading the tensor gets it from its producer's stage, after its
    # forward, so the write must happen there, and a reader before the write must not be in a later stage.
    def pin(first: int, last: int) -> None:
        for j in range(first, last):
            ok[j] = False

    for k, node in enumerate(nodes):
        target: Any = node.args[0] if _writes_in_place(gm, node) and node.args else None
        if not hasattr(target, "op"):
            continue
        base: Any = target
        while _op_name(base) in _VIEWS and base.args and hasattr(base.args[0], "op"):
            base = base.args[0]
        if base.name in position and (base is not target or len(base.users) > 1):
            pin(position[base.name], k)
        elif base.op == "placeholder" and base is not target:
            # A write into a view of a model input: every later reader of the input reads it in this stage
            # (another stage reads the batch as given).
            pin(k, max((position[u.name] for u in _aliases(base) for u in u.users if u.name in position), default=k))
    # A buffer the forward writes (a running mean, a counter): its writes and reads stay in one stage, in order
    # (two stages would each update their own copy).
    from partitioner.graph.capture import written_state_nodes

    for names in written_state_nodes(gm).values():
        spots = [position[n] for n in names if n in position]
        if spots:
            pin(min(spots), max(spots))
    return ok


def pinned_state(gm: fx.GraphModule) -> str:
    """Why a run of ``gm``'s nodes cannot be cut: the buffer written in forward whose reads and writes span the
    most nodes (they stay in one stage), or "" when none spans more than one.

    >>> import torch
    >>> from partitioner.graph.capture import capture
    >>> class Twice(torch.nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.bn = torch.nn.BatchNorm1d(3)
    ...     def forward(self, x):
    ...         return self.bn(torch.tanh(self.bn(x)))
    >>> pinned_state(capture(Twice(), (torch.randn(4, 3),)).graph_module)
    'the buffer bn.running_var is written in forward and read from node bn to node bn_1, which stay in one stage'
    """
    from partitioner.graph.capture import written_state_nodes

    position = {n.name: i for i, n in enumerate(compute_nodes(gm))}
    spans = [(position[names[-1]] - position[names[0]], name, names) for name, names in written_state_nodes(gm).items()
             if len(names) > 1 and names[0] in position and names[-1] in position]
    if not spans:
        return ""
    _, name, names = max(spans)
    return (f"the buffer {name} is written in forward and read from node {names[0]} to node {names[-1]}, which stay "
            "in one stage")


def _aliases(base: Any) -> list[Any]:
    """``base`` and every view of it (through :data:`_VIEWS` ops), in no order."""
    found, stack = [base], [base]
    while stack:
        for user in stack.pop().users:
            if _op_name(user) in _VIEWS and user.args and user.args[0] in found and user not in found:
                found.append(user)
                stack.append(user)
    return found


# Ops whose output may share its first argument's storage (a superset: a reshape that copies only
# blocks a few more cuts where a write follows).
_VIEWS = frozenset({
    "view", "_unsafe_view", "view_as", "reshape", "slice", "select", "narrow", "expand", "expand_as", "unsqueeze",
    "squeeze", "transpose", "permute", "t", "as_strided", "alias", "diagonal", "unfold", "getitem", "__getitem__",
    "flatten", "unflatten", "split", "chunk", "unbind", "movedim", "swapaxes", "detach",
})
_IN_PLACE_OPERATORS = frozenset({"setitem", "iadd", "isub", "imul", "itruediv"})


def _op_name(node: Any) -> str:
    """``slice`` for ``aten.slice.Tensor``, the method's or function's name otherwise."""
    if node.op == "call_method":
        return str(node.target)
    if node.op != "call_function":
        return ""
    text = str(node.target)
    if text.startswith("aten."):
        return text.split(".")[1]
    return str(getattr(node.target, "__name__", text))


def _writes_in_place(gm: fx.GraphModule, node: Any) -> bool:
    """Does ``node`` write into its first argument (``masked_fill_``, ``copy_``, ``x[i] = v``, ``x += y``,
    ``F.relu(x, inplace=True)``, ``nn.ReLU(inplace=True)``)?"""
    if node.op == "call_module":
        return getattr(gm.get_submodule(str(node.target)), "inplace", False) is True
    name = _op_name(node)
    return (name.endswith("_") and not name.endswith("__")) or name in _IN_PLACE_OPERATORS \
        or node.kwargs.get("inplace") is True


def _runs(keys: list[tuple[str, ...]], cuttable: list[bool]) -> list[list[int]]:
    runs: list[list[int]] = [[0]]
    for i in range(1, len(keys)):
        if keys[i] != keys[i - 1] and cuttable[i - 1]:
            runs.append([i])
        else:
            runs[-1].append(i)
    return runs


def _merge_evenly(runs: list[list[int]], max_blocks: int, weight: list[float]) -> list[list[int]]:
    """Merge neighbouring runs into at most ``max_blocks`` of roughly equal weight."""
    total = sum(weight)
    target = total / max_blocks
    merged: list[list[int]] = []
    acc = 0.0
    for run in runs:
        w = sum(weight[i] for i in run)
        if merged and acc + w <= target * 1.0000001 or (merged and len(merged) >= max_blocks):
            merged[-1].extend(run)
            acc += w
        else:
            merged.append(list(run))
            acc = w
    return merged
