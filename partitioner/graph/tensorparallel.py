"""Find the layers tensor parallelism can split in a captured graph (Megatron's column/row pairs).

A *pair* (Shoeybi et al., "Megatron-LM", arXiv:1909.08053, section 3) is a set
of linear layers reading one value (the *columns*: an MLP's up and gate
projections, attention's q, k and v or GPT-2's fused ``c_attn``), the ops
between them and one linear that narrows back to the columns' input width (the
*row*: the MLP's down projection, attention's output projection), where every
value the columns make flows only into the row, through ops that work on each
column (or head) on its own: elementwise ops, views that split the last
dimension into heads, transposes, ``matmul``/``bmm`` of two such values,
softmax over the last dimension, ``scaled_dot_product_attention``, rotary
embeddings (slices and concatenations within a head), dropout.  Values from
outside the pair may join only if smaller than what they join (a mask, cos and
sin tables), never the residual stream itself.  Such a pair splits over ``tp``
GPUs by columns then rows, and communicates only after the row (forward) and
before the columns (backward): :mod:`partitioner.cost.tensorparallel`.

A pair's roles are written only when the split holds (:func:`_split_breaks`): the
columns' output, split by features into contiguous shares, must stay one whole
dimension of every value up to the row's input features.  A fused projection viewed
as ``(B, T, 3, heads, head_dim)`` or cut into q, k and v along the split (GPT-2's
``c_attn``) does not: each GPU would hold q and part of k, so the runtime would
gather (or fail to unflatten) what the planner priced split.  Such a pair runs
whole, priced so (``TPLayout.whole``), with the reason in ``TPLayout.dropped``.  A
parameter read in several places gets one placement: where two readers would split
it differently, their patterns run whole (:func:`_one_placement_per_parameter`).

Heads: a column whose value is viewed as ``(..., H, D)`` with ``H x D`` its
width (or a third of it, fused q/k/v) splits by heads: ``tp`` must divide the
query heads, and divide the key/value heads or be a multiple of them (they are
then replicated, grouped-query attention).  Other columns (MLPs) split by width.

The vocabulary (Megatron, section 3): the largest embedding table (the token
embedding; position embeddings stay replicated) is split by rows, and the
linear that produces vocabulary-sized values (the LM head) by columns, with
everything after it that still has the vocabulary as last dimension (the
cross-entropy on the logits: ``loss_parallel``).  Norms, residual adds and
everything else are replicated (split along the sequence with sequence
parallelism).

:func:`find_tensor_parallel` writes each split node's :class:`TPRole` under
:data:`TP_KEY` in ``node.meta`` (and ``True`` under :data:`WHOLE_KEY` on the nodes of a pair kept whole) and returns a :class:`TPLayout` (plain data, no
torch: the solver's side reads it).  A graph without any pair gets an empty
layout whose ``reason`` says why (the plan keeps ``tp = 1`` and the report
says so).  Only names are read here: this module imports without torch.

Example::

    >>> import torch
    >>> from partitioner.graph.capture import capture
    >>> from partitioner.graph.values import propagate_values
    >>> m = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Linear(32, 8))
    >>> x = torch.randn(2, 8)
    >>> c = capture(m, (x,)); _ = propagate_values(c.graph_module, (x,))
    >>> layout = find_tensor_parallel(c)
    >>> [(p.kind, p.columns, p.row, p.width) for p in layout.patterns], layout.degrees(8)
    ([('mlp', ('_0',), '_2', 32)], (1, 2, 4, 8))
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Literal

from partitioner.graph.ir import KIND_KEY, VALUE_KEY, ValueInfo, node_parameters

if TYPE_CHECKING:
    from torch import fx

    from partitioner.graph.capture import CapturedModel

__all__ = ["LOCAL_KEY", "TP_KEY", "WHOLE_KEY", "TPLayout", "TPPattern", "TPRole", "degrees", "find_tensor_parallel",
           "runs_by_heads"]

TP_KEY = "autopartition_tp"  # node.meta key: the node's TPRole (split nodes only)
WHOLE_KEY = "autopartition_tp_whole"  # node.meta key: True on the nodes of a pair kept whole (TPLayout.whole)
LOCAL_KEY = "autopartition_tp_local"  # node.meta key: the op DTensor has no rule for; the node runs on whole values

PatternKind = Literal["attention", "mlp", "embedding", "head"]
RoleKind = Literal["column", "row", "inner", "embedding", "head", "vocab"]

# Ops a split value may pass through between a pair's columns and its row (names without overloads).
_ELEMENTWISE = frozenset({
    "add", "sub", "mul", "div", "neg", "pow", "tanh", "gelu", "silu", "relu", "sigmoid", "exp", "erf", "sqrt",
    "rsqrt", "abs", "clamp", "where", "masked_fill", "dropout", "native_dropout", "clone", "contiguous", "to",
    "_to_copy", "type", "type_as", "float", "half", "bfloat16", "alias", "detach", "mul_", "add_", "masked_fill_",
    "truediv", "iadd", "imul", "lift_fresh_copy", "getattr", "size", "sym_size", "newgeluactivation",
    "geluactivation", "gelupytorchtanh", "siluactivation", "quickgeluactivation", "relu6", "identity",
})
_SHAPE = frozenset({
    "view", "reshape", "_unsafe_view", "transpose", "permute", "expand", "unsqueeze", "squeeze", "split",
    "split_with_sizes", "chunk", "getitem", "slice", "cat", "narrow", "repeat_interleave", "flatten",
    "unflatten", "select", "t", "unbind",
})
_ATTENTION = frozenset({
    "matmul", "bmm", "baddbmm", "softmax", "_softmax", "scaled_dot_product_attention",
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_cudnn_attention",
})
# Reductions over chosen dimensions (a norm over each head's features: Qwen3's, Gemma 3's, OLMo 2's per-head q/k
# RMSNorm): a split value may pass where they leave its split dimension alone (:func:`_carry` checks which).
_REDUCE_OVER = frozenset({"mean", "sum", "amax", "amin", "var", "std", "norm", "linalg_vector_norm"})
_NORMALIZE = frozenset({"rms_norm", "layer_norm", "native_layer_norm", "_fused_rms_norm",  # over the last dims
                        "rmsnorm", "layernorm"})  # torch.nn's modules, kept whole by symbolic tracing
_ALLOWED = _ELEMENTWISE | _SHAPE | _ATTENTION | _REDUCE_OVER | _NORMALIZE
# After the LM head: ops on vocabulary-sized values that a vocabulary-parallel loss computes in place.
_LOSS = frozenset({"log_softmax", "_log_softmax", "cross_entropy", "nll_loss", "nll_loss_forward",
                   "nll_loss2d", "crossentropyloss"})
_LINEAR = frozenset({"linear", "addmm", "mm", "conv1d_hf"})
_LINEAR_MODULES = frozenset({"linear", "conv1d", "nondynamicallyquantizablelinear"})
_EMBEDDING = frozenset({"embedding"})

NO_PATTERN = ("no column/row pair of linear layers: no linear is followed, through elementwise ops, views "
              "or attention, by one that narrows back to its input width")


@dataclasses.dataclass(frozen=True)
class TPRole:
    """How one node splits: its pattern (index into ``TPLayout.patterns``), role and the units it splits into.

    ``units``: heads (a head-split column and what follows it), columns (an MLP)
    or vocabulary entries (``embedding``, ``head``, ``vocab``).
    """

    pattern: int
    role: RoleKind
    units: int


@dataclasses.dataclass(frozen=True)
class TPPattern:
    """One splittable group: a column/row pair (attention or MLP), the token embedding or the LM head.

    ``comm_node``: the node whose value is the ``b x s x h`` tensor the group's
    collectives move (the row's output; the embedding's output; the head's input).
    ``heads``: (query, key/value) heads of an attention; ``width``: the split
    width of an MLP, or the vocabulary.
    """

    kind: PatternKind
    columns: tuple[str, ...]
    row: str | None
    comm_node: str
    width: int
    heads: tuple[int, int] | None = None
    hidden: int = 0  # last dimension of ``comm_node``'s value (the model width)


@dataclasses.dataclass(frozen=True)
class TPLayout:
    """The splittable nodes and parameters of a graph (plain data; :func:`find_tensor_parallel`).

    ``parameters``: canonical parameter name -> (pattern, units) for every
    parameter that splits (a row's bias and the norms are not in it: replicated).
    ``reason``: why nothing splits ("" when something does).  ``dropped``: pairs
    found but left replicated (their row -> why: the split does not survive what
    reads it, or a parameter they share with another layer would be placed two ways), ``whole``
    their nodes, which run whole on every GPU of a group (priced so).
    """

    roles: Mapping[str, TPRole]
    patterns: tuple[TPPattern, ...]
    parameters: Mapping[str, tuple[int, int]]
    reason: str = ""
    dropped: Mapping[str, str] = dataclasses.field(default_factory=dict)  # a pair's row -> why it stays whole
    whole: frozenset[str] = frozenset()  # the nodes of those pairs: they run whole on every GPU of a group
    # Nodes running an op DTensor has no sharding rule for (forward or backward) -> that op: each runs on
    # whole local values on every GPU of a group (runtime: LocalCall), and is priced whole (in ``whole``).
    local: Mapping[str, str] = dataclasses.field(default_factory=dict)

    @property
    def pairs(self) -> tuple[TPPattern, ...]:
        return tuple(p for p in self.patterns if p.kind in ("attention", "mlp"))

    def degrees(self, gpus_per_node: int) -> tuple[int, ...]:
        """Tensor-parallel degrees every pair allows inside a node (:func:`degrees`).

        The vocabulary never limits them (it is padded).  Without a pair: ``(1,)``.
        """
        if not self.pairs:
            return (1,)
        heads = {p.heads for p in self.pairs if p.heads is not None}
        widths = {p.width for p in self.pairs if p.heads is None}
        return degrees(gpus_per_node, heads, widths)

    def why_not(self, gpus_per_node: int) -> str:
        """Why no degree above 1 is allowed on nodes of ``gpus_per_node`` ("" when one is)."""
        if self.reason:
            return self.reason
        if len(self.degrees(gpus_per_node)) > 1:
            return ""
        heads = sorted({p.heads for p in self.pairs if p.heads is not None})
        widths = sorted({p.width for p in self.pairs if p.heads is None})
        return (f"no divisor of {gpus_per_node} GPUs per node above 1 splits every pair: attention heads "
                f"(query, key/value) {heads}, MLP widths {widths}")

    def summary(self) -> str:
        """One line: what splits.

        >>> TPLayout({}, (), {}, reason="no pair").summary()
        'tensor parallelism: none (no pair)'
        """
        if not self.patterns:
            return f"tensor parallelism: none ({self.reason})"
        count = {k: sum(p.kind == k for p in self.patterns) for k in ("attention", "mlp", "embedding", "head")}
        heads = sorted({p.heads for p in self.patterns if p.heads is not None})
        parts = [f"{count['attention']} attention (heads {', '.join(f'{q}/{kv}' for q, kv in heads)})"
                 if count["attention"] else "", f"{count['mlp']} MLP" if count["mlp"] else "",
                 "vocabulary-parallel embedding" if count["embedding"] else "",
                 "vocabulary-parallel head" if count["head"] else ""]
        row, why = next(iter(self.dropped.items()), ("", ""))
        whole = f"; {len(self.dropped)} pair{'s' if len(self.dropped) > 1 else ''} kept whole ({row}: {why})" \
            if self.dropped else ""
        node, op = next(iter(self.local.items()), ("", ""))
        local = f"; {len(self.local)} node{'s run' if len(self.local) > 1 else ' runs'} whole, DTensor having no " \
            f"rule for an op of theirs ({node}: {op})" if self.local else ""
        return "tensor parallelism: " + ", ".join(p for p in parts if p) + whole + local


def degrees(gpus_per_node: int, heads: Iterable[tuple[int, int]], widths: Iterable[int] = ()) -> tuple[int, ...]:
    """The tensor-parallel degrees a model allows on nodes of ``gpus_per_node`` GPUs.

    The divisors of ``gpus_per_node`` (a group stays inside a node) that divide
    every attention's query heads, whose key/value heads they divide or are a
    multiple of (``heads``: (query, key/value) per attention), and that divide
    every other split width (``widths``: an MLP's hidden units).  1 is always one.

    >>> degrees(8, [(64, 8)], [28672])
    (1, 2, 4, 8)
    >>> degrees(8, [(12, 12)], [3072]), degrees(8, [(4, 2)], [176]), degrees(6, [(6, 2)])
    ((1, 2, 4), (1, 2, 4), (1, 2, 6))
    """
    heads, widths = list(heads), list(widths)
    out = []
    for t in range(1, gpus_per_node + 1):
        if gpus_per_node % t:
            continue
        if all(q % t == 0 and (kv % t == 0 or t % kv == 0) for q, kv in heads) and all(w % t == 0 for w in widths):
            out.append(t)
    return tuple(out)


def find_tensor_parallel(captured: CapturedModel) -> TPLayout:
    """Annotate the splittable nodes of ``captured`` (values propagated) and return its :class:`TPLayout`."""
    gm = captured.graph_module
    nodes = [n for n in gm.graph.nodes if n.meta.get(KIND_KEY) == "compute"]
    for n in gm.graph.nodes:
        n.meta.pop(TP_KEY, None)
        n.meta.pop(WHOLE_KEY, None)
        n.meta.pop(LOCAL_KEY, None)
    linears = {n for n in nodes if _is_linear(gm, n)}
    roles: dict[str, TPRole] = {}
    patterns: list[TPPattern] = []
    parameters: dict[str, tuple[int, int]] = {}

    def own(pattern: int, node: fx.Node, role: RoleKind, units: int) -> None:
        roles[node.name] = TPRole(pattern, role, units)
        for p in node_parameters(gm, node):
            if role == "row" and _is_bias(gm, node, p):
                continue  # a row's bias is added once, after the all-reduce: replicated
            parameters.setdefault(captured.parameter_names.get(p, p), (pattern, units))

    refused: dict[str, str] = {}  # row -> why its pair stays replicated
    whole: set[str] = set()  # the nodes of the pairs refused
    for row in nodes:
        if row not in linears or row.name in roles:
            continue
        found = _pair(row, linears)
        if found is None:
            continue
        columns, region = found
        if any(c.name in roles for c in columns):
            continue
        heads = {c: _heads(c, region) for c in columns}
        broken = _split_breaks(columns, region, row, heads) or _not_run_by_dtensor(gm, columns, region, row)
        if broken:
            refused[row.name] = broken
            whole.update(n.name for n in (*columns, *region, row))
            continue
        widths = {c: _width(c) for c in columns}
        index = len(patterns)
        counted = [h for h in heads.values() if h is not None]
        if counted:
            q, kv = max(counted), min(counted)
            patterns.append(TPPattern("attention", tuple(c.name for c in columns), row.name, row.name,
                                      widths[columns[0]] or 0, (q, kv)))
        else:
            width = min(w for w in widths.values() if w)
            patterns.append(TPPattern("mlp", tuple(c.name for c in columns), row.name, row.name, width))
        pattern = patterns[-1]
        for c in columns:
            units = heads[c]
            own(index, c, "column", units if units is not None else pattern.width)
        # What follows a key/value column alone splits by its heads; the rest by the query heads.
        units_of = _region_units(columns, region, heads, pattern)
        for n in region:
            roles[n.name] = TPRole(index, "inner", units_of.get(n, pattern.heads[0] if pattern.heads else pattern.width))
        own(index, row, "row", pattern.heads[0] if pattern.heads else pattern.width)
    _vocabulary(gm, captured, [n for n in nodes if n.name not in whole], linears, roles, patterns, own)
    roles, patterns, parameters = _one_placement_per_parameter(gm, captured, roles, patterns, parameters, refused,
                                                               whole)
    local = _local_nodes(gm, [n for n in nodes if n.name not in roles]) if patterns else {}
    whole.update(local)
    for n in gm.graph.nodes:
        if n.name in roles:
            n.meta[TP_KEY] = roles[n.name]
        elif n.name in whole:
            n.meta[WHOLE_KEY] = True
        if n.name in local:
            n.meta[LOCAL_KEY] = local[n.name]
    pairs = any(p.kind in ("attention", "mlp") for p in patterns)
    reason = "" if pairs else NO_PATTERN if not refused else (
        "no column/row pair keeps its split: " + "; ".join(f"{row}: {why}" for row, why in refused.items()))
    return TPLayout(roles, tuple(patterns), parameters, reason, dropped=dict(refused), whole=frozenset(whole),
                    local=local)


# ------------------------------------------------------------------ pairs


def _pair(row: fx.Node, linears: set[fx.Node]) -> tuple[list[fx.Node], list[fx.Node]] | None:
    """(columns, the nodes between them and ``row``) if ``row`` closes a column/row pair, else None."""
    source = _activation(row)
    if source is None:
        return None
    columns: dict[fx.Node, None] = {}
    seen: set[fx.Node] = set()
    stack = [source]
    while stack:  # backwards from the row's input through allowed ops: the linears it reaches are columns
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if n in linears:
            columns[n] = None
            continue
        if n.meta.get(KIND_KEY) != "compute" or _name(n) not in _ALLOWED or _info(n).kind == "static":
            continue  # a shape read (x.size(1)) carries no split: the value it was read from is no column's
        stack.extend(n.all_input_nodes)
    if not columns:
        return None
    cols = list(columns)
    inputs = {_activation(c) for c in cols}
    if len(inputs) != 1 or None in inputs:
        return None
    (x,) = inputs
    if x is None or _last(x) is None or _last(x) != _last(row):
        return None  # the row narrows back to the columns' input width
    region: dict[fx.Node, None] = {}
    stack = [u for c in cols for u in c.users]
    while stack:  # forwards from the columns: every value must end in the row
        n = stack.pop()
        if n is row or n in region:
            continue
        if n in linears or n.op == "output" or n.meta.get(KIND_KEY) != "compute" or _name(n) not in _ALLOWED:
            return None
        region[n] = None
        stack.extend(n.users)
    inside = set(region) | set(cols)
    for n in region:  # values joining from outside must be smaller than the split one (masks, rotary tables)
        own = _numel(n)
        for a in n.all_input_nodes:
            if a not in inside and a.meta.get(KIND_KEY) in ("compute", "input") and own is not None:
                other = _numel(a)
                if other is not None and other >= own and _info(a).kind == "tensor":
                    return None
    if source not in region and source not in columns:
        return None
    order = {n: i for i, n in enumerate(row.graph.nodes)}
    return sorted(cols, key=order.__getitem__), sorted(region, key=order.__getitem__)


def _heads(column: fx.Node, region: list[fx.Node]) -> int | None:
    """Heads of a column: H of the first view of its value (or of a fused third) as (..., H, D), else None."""
    width = _width(column)
    if not width:
        return None
    inside = set(region)
    stack, seen = list(column.users), set()
    while stack:
        n = stack.pop(0)
        if n in seen or n not in inside:
            continue
        seen.add(n)
        info = _info(n)
        if _name(n) in ("view", "reshape", "_unsafe_view", "unflatten") and info.kind == "tensor" and len(info.shape) >= 2:
            h, d = info.shape[-2], info.shape[-1]
            if h > 1 and d > 1 and width % (h * d) == 0 and width // (h * d) <= 3:
                return h
        if _name(n) in _ELEMENTWISE | {"view", "reshape", "_unsafe_view", "split", "split_with_sizes", "chunk",
                                      "getitem"}:
            stack.extend(n.users)
    return None


def _region_units(columns: list[fx.Node], region: list[fx.Node], heads: dict[fx.Node, int | None],
                  pattern: TPPattern) -> dict[fx.Node, int]:
    """Per region node, the units it splits into: key/value heads where only key/value columns reach it."""
    if pattern.heads is None or pattern.heads[0] == pattern.heads[1]:
        return {}
    q = pattern.heads[0]
    inside = set(region)
    reach: dict[fx.Node, set[int]] = {}
    for c in columns:
        stack = list(c.users)
        while stack:
            n = stack.pop()
            if n not in inside:
                continue
            got = reach.setdefault(n, set())
            counted_heads = heads[c]
            h = counted_heads if counted_heads is not None else q
            if h in got:
                continue
            got.add(h)
            stack.extend(n.users)
    return {n: min(hs) if q not in hs else q for n, hs in reach.items()}


# ------------------------------------------------------------------ does the split survive?

_VIEWS = frozenset({"view", "reshape", "_unsafe_view", "flatten", "unflatten", "expand", "unsqueeze", "squeeze",
                    "expand_as", "view_as", "reshape_as"})
_PERMUTES = frozenset({"transpose", "permute", "t", "swapaxes", "movedim"})
_CHUNKS = frozenset({"split", "split_with_sizes", "chunk", "unbind", "tensor_split"})
_REDUCE_ALONG = frozenset({"softmax", "_softmax", "log_softmax", "_log_softmax", "cumsum"})
_NO_VALUE = frozenset({"size", "sym_size", "getattr", "dim"})  # read shapes, not values
_SDPA_OPS = frozenset(name for name in _ATTENTION if "attention" in name)


def _split_breaks(columns: list[fx.Node], region: list[fx.Node], row: fx.Node,
                  heads: Mapping[fx.Node, int | None]) -> str:
    """Why a column split does not reach ``row`` intact ("" when it does).

    Each column's output is split along its last dimension into contiguous shares
    (``Shard`` of its output features); the share must stay one dimension of every
    value in between, whole (elementwise ops, views that split it as
    ``(heads, head_dim)`` or merge it back, permutes, attention over heads), and
    arrive as the row's input features.  A view whose leading factor is not a
    multiple of the column's heads (a fused ``(3, heads, head_dim)``), an index,
    slice, ``split`` or softmax along it (a fused ``3 x hidden`` output split into
    q, k and v), or a matmul contracting it would need the whole value on every GPU.
    """
    dims: dict[fx.Node, tuple[int, int]] = {}  # value -> (its split dimension, the units it splits into)
    for c in columns:
        shape = _shape(c)
        if not shape:
            return f"{c.name} has no known shape"
        units = heads.get(c)
        dims[c] = (len(shape) - 1, units if units is not None else shape[-1])
    for n in region:
        split = [(a, dims[a]) for a in n.all_input_nodes if a in dims]
        name = _name(n)
        if not split or name in _NO_VALUE:
            continue
        found = _carry(n, name, split)
        if isinstance(found, str):
            return f"{n.name} ({name}) {found}"
        dims[n] = found
    source = _activation(row)
    if source is None or source not in dims:
        return f"the row {row.name} reads no split value"
    shape = _shape(source)
    if shape is None or dims[source][0] != len(shape) - 1:
        return f"the row {row.name} reads the split along dimension {dims[source][0]}, not its input features"
    return ""


def _carry(node: fx.Node, name: str, split: list[tuple[fx.Node, tuple[int, int]]]) -> tuple[int, int] | str:
    """The split dimension and units of ``node``'s value from its split inputs', or why it breaks."""
    first, (dim, units) = split[0]
    before, after = _shape(first), _shape(node)
    if name in _SDPA_OPS:  # (B, H, T, D) inputs, split by heads: the output stays split by heads
        if any(d != len(_shape(a) or ()) - 3 for a, (d, _) in split):
            return "runs attention on a value not split by heads"
        return dim, units
    if name in _CHUNKS:
        along = _dim_argument(node, 1 if name == "unbind" else 2, default=0, ndim=len(before or ()))
        if along is None or along == dim:
            return "cuts the split dimension into parts (a fused projection whose parts are not each split)"
        return (dim - 1 if name == "unbind" and along < dim else dim), units
    if before is None or after is None or _info(node).kind != "tensor":
        return dim, units  # a tuple (a split's parts, dropout's mask) or getitem of one: carried as it is
    if name == "getitem":
        return _indexed(node, dim, units, before)
    if name in _ELEMENTWISE or name in ("repeat_interleave", "baddbmm", "matmul", "bmm"):
        aligned = {d + len(after) - len(_shape(a) or ()) for a, (d, _) in split}
        if len(aligned) > 1:
            return "joins values split along different dimensions"
        (out,) = aligned
        if name in ("matmul", "bmm", "baddbmm") and out >= len(after) - 2:
            return "multiplies along the split dimension (a partial sum, not a split)"
        return out, min(u for _, (_, u) in split)
    if name in _REDUCE_OVER or name in _NORMALIZE:
        return _reduced(node, name, dim, units, before)
    if name in _REDUCE_ALONG or name in ("select", "narrow", "slice", "cat", "index_select", "gather"):
        default = -1 if name in _REDUCE_ALONG else 0
        along = _dim_argument(node, 1, default=default, ndim=len(before if name != "cat" else after))
        if along is None or along == dim:
            return "works along the split dimension"
        return (dim - 1 if name == "select" and along < dim else dim), units
    if name in _PERMUTES:
        order = _permutation(node, name, len(before))
        if order is None:
            return "permutes in a way not read here"
        return order.index(dim), units
    if name in _VIEWS:
        return _viewed(dim, units, before, after)
    return "is an op the split is not known to survive"


def _reduced(node: fx.Node, name: str, dim: int, units: int, before: tuple[int, ...]) -> tuple[int, int] | str:
    """A reduction or a norm: it must leave the split dimension out of the dimensions it works over (a head's
    features, each on the GPU holding the head); the split moves up by the dimensions removed before it."""
    ndim = len(before)
    if name in _NORMALIZE:  # normalized over the trailing len(normalized_shape) dimensions, shape kept
        module = node.graph.owning_module.get_submodule(str(node.target)) \
            if node.op == "call_module" and node.graph.owning_module is not None else None
        shape = getattr(module, "normalized_shape", None) if module is not None else \
            node.args[1] if len(node.args) > 1 else node.kwargs.get("normalized_shape")
        if not isinstance(shape, (list, tuple)):
            return "normalizes over dimensions not read here"
        return (dim, units) if dim < ndim - len(shape) else "normalizes along the split dimension"
    over = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    if over is None or (isinstance(over, (list, tuple)) and not over):
        return "reduces every dimension, the split one too"
    dims = [over] if isinstance(over, int) else list(over) if isinstance(over, (list, tuple)) else [None]
    if not all(isinstance(d, int) and not isinstance(d, bool) for d in dims):
        return "reduces over dimensions not read here"
    dims = [int(d) % ndim for d in dims if isinstance(d, int)]
    if dim in dims:
        return "reduces along the split dimension (a partial result on each GPU)"
    keep = node.kwargs.get("keepdim", node.args[2] if len(node.args) > 2 else False)
    return (dim if keep else dim - sum(d < dim for d in dims)), units


def _viewed(dim: int, units: int, before: tuple[int, ...], after: tuple[int, ...]) -> tuple[int, int] | str:
    """The split dimension after a view from ``before`` to ``after`` (row-major): it must start a dimension of
    ``after``; a larger one merges it with the dimensions after it, a smaller one splits it (its leading
    factor must be a multiple of the units: ``(heads, head_dim)``)."""
    start = 1
    for size in before[:dim]:
        start *= size
    offset = 1
    for k, size in enumerate(after):
        if offset == start and (size != 1 or before[dim] == 1):
            if size == before[dim]:
                return k, units
            if size > before[dim]:  # merged with the dimensions after it: the split still leads
                return (k, units) if size % before[dim] == 0 else "views the split dimension unevenly"
            if before[dim] % size == 0 and size % units == 0:
                return k, units
            return (f"views the split dimension ({before[dim]}) as ({size}, ...), whose {size} is not a multiple of "
                    f"the {units} units it splits into (a fused (3, heads, head_dim) view, say)")
        offset *= size
        if offset > start:
            break
    return "merges the split dimension into the one before it"


def _indexed(node: fx.Node, dim: int, units: int, before: tuple[int, ...]) -> tuple[int, int] | str:
    """``x[index]``: the split dimension must be taken whole (``:``); dimensions before it may go or come."""
    index = node.args[1] if len(node.args) > 1 else None
    items = list(index) if isinstance(index, tuple) else [index]
    if not all(i is None or i is Ellipsis or isinstance(i, (int, slice)) for i in items):
        return "is indexed by a tensor"
    if Ellipsis in items:  # ... stands for the dimensions the other items leave
        at = items.index(Ellipsis)
        named = sum(1 for i in items if i is not None and i is not Ellipsis)
        items[at:at + 1] = [slice(None)] * (len(before) - named)
    out = 0
    position = 0  # the input dimension the next item indexes
    for item in items:
        if item is None:
            out += 1
            continue
        if position == dim:
            if not (isinstance(item, slice) and item == slice(None)):
                return "indexes or slices the split dimension"
            return out, units
        position += 1
        out += 0 if isinstance(item, int) else 1
    return out + (dim - position), units


def _dim_argument(node: fx.Node, position: int, *, default: int, ndim: int) -> int | None:
    """The dimension argument at ``position`` (or ``dim=``), made non-negative; None when not a plain int."""
    value = node.args[position] if len(node.args) > position else node.kwargs.get("dim", default)
    if not isinstance(value, int) or isinstance(value, bool):
        return None
    return value % ndim if ndim else value


def _permutation(node: fx.Node, name: str, ndim: int) -> list[int] | None:
    """``order[k]``: the input dimension output dimension k comes from (None: not read here)."""
    args = list(node.args[1:])
    if name == "t":
        return [1, 0] if ndim == 2 else list(range(ndim))
    ints = [a for a in args if isinstance(a, int)]
    if name in ("transpose", "swapaxes") and len(args) >= 2 and len(ints) >= 2 and ints[:2] == args[:2]:
        a, b = (x % ndim for x in ints[:2])
        order = list(range(ndim))
        order[a], order[b] = order[b], order[a]
        return order
    if name == "permute":
        dims = list(args[0]) if len(args) == 1 and isinstance(args[0], (list, tuple)) else args
        found = [d for d in dims if isinstance(d, int)]
        if len(found) == len(dims) == ndim:
            return [d % ndim for d in found]
    return None


def _shape(node: fx.Node) -> tuple[int, ...] | None:
    info = _info(node)
    return tuple(info.shape) if info.kind == "tensor" else None


def runs_by_heads(node: fx.Node) -> bool:
    """Scaled dot-product attention, which the runtime runs on each GPU's heads itself (``local_map``), whatever
    kernel the backend picks: DTensor's rules for it are not needed."""
    return node.op == "call_function" and "scaled_dot_product_attention" in str(node.target)


def _local_nodes(gm: fx.GraphModule, nodes: list[fx.Node]) -> dict[str, str]:
    """The nodes (not split) that run an op DTensor has no sharding rule for -> the first such op."""
    from partitioner.graph.tpops import unsupported_ops

    found = {}
    for n in nodes:
        if n.op in ("call_function", "call_module") and not runs_by_heads(n) and (ops := unsupported_ops(gm, n)):
            found[n.name] = ops[0]
    return found


def _not_run_by_dtensor(gm: fx.GraphModule, columns: list[fx.Node], region: list[fx.Node], row: fx.Node) -> str:
    """Why DTensor cannot run the pair split ("" when it can): an op of its nodes (or of what makes the columns'
    and row's weights: a parametrization) that has no sharding rule, forward or backward (:mod:`.tpops`)."""
    from partitioner.graph.tpops import pair_unsupported

    weights = [a for n in (*columns, row) for a in n.all_input_nodes
               if a.meta.get(KIND_KEY) == "compute" and a is not _activation(n)]
    found = pair_unsupported(gm, [n for n in (*weights, *columns, *region, row) if not runs_by_heads(n)])
    if found is None:
        return ""
    node, op = found
    return f"{node} runs {op}, which DTensor has no sharding rule for (the pair runs whole)"


# ------------------------------------------------------------------ one placement per parameter


def _placement_key(gm: fx.GraphModule, node: fx.Node, param: str, role: TPRole | None) -> tuple[str, int]:
    """How ``node``'s role splits ``param``: (dimension of the tensor, units), or whole (runtime/parallel/tensorparallel.py)."""
    if role is None or role.role not in ("column", "row", "embedding", "head"):
        return ("whole", 0)
    dim2 = _param_dim(gm, param) == 2
    in_out = node.op == "call_module" and _name(node) == "conv1d" or (
        node.op != "call_module" and _name(node) in ("addmm", "mm", "conv1d_hf"))
    out = 1 if in_out and dim2 else 0
    if role.role == "row":
        return (f"dim{1 - out}", role.units) if dim2 else ("whole", 0)
    return (f"dim{0 if role.role == 'embedding' else out}", role.units)


def _one_placement_per_parameter(
    gm: fx.GraphModule, captured: CapturedModel, roles: dict[str, TPRole], patterns: list[TPPattern],
    parameters: dict[str, tuple[int, int]], refused: dict[str, str], whole: set[str],
) -> tuple[dict[str, TPRole], list[TPPattern], dict[str, tuple[int, int]]]:
    """Drop the patterns whose parameters another reader would place another way, and renumber the rest.

    A parameter read in several places (an embedding's weight read again by ``h @ emb.weight.T``, a layer
    applied at every depth) has one placement on each GPU, and its copies in several stages are summed
    shard for shard: every node reading it must split it alike, or none may.  Dropped patterns stay
    replicated (and are priced so: the cost passes read only the patterns kept).
    """
    readers: dict[str, list[fx.Node]] = {}
    for n in gm.graph.nodes:
        if n.meta.get(KIND_KEY) == "compute":
            for p in node_parameters(gm, n):
                readers.setdefault(p, []).append(n)
    dropped: set[int] = set()
    while True:
        live = {k: r for k, r in roles.items() if r.pattern not in dropped}
        conflict = None
        for p, nodes in readers.items():
            keys = {_placement_key(gm, n, p, live.get(n.name)) for n in nodes}
            if len(keys) > 1:
                conflict = (p, nodes)
                break
        if conflict is None:
            break
        p, nodes = conflict
        name = captured.parameter_names.get(p, p)
        for n in nodes:
            role = live.get(n.name)
            if role is not None:
                dropped.add(role.pattern)
                row = patterns[role.pattern].row or patterns[role.pattern].columns[0]
                refused.setdefault(row, f"{name} is read elsewhere ({', '.join(m.name for m in nodes[:3])}) "
                                        "in a way that would place it differently")
    if not dropped:
        return roles, patterns, parameters
    whole.update(k for k, r in roles.items() if r.pattern in dropped)
    index = {old: new for new, old in enumerate(i for i in range(len(patterns)) if i not in dropped)}
    return ({k: dataclasses.replace(r, pattern=index[r.pattern]) for k, r in roles.items() if r.pattern in index},
            [p for i, p in enumerate(patterns) if i in index],
            {k: (index[pat], u) for k, (pat, u) in parameters.items() if pat in index})


# ------------------------------------------------------------------ vocabulary


def _vocabulary(gm: fx.GraphModule, captured: CapturedModel, nodes: list[fx.Node], linears: set[fx.Node],
                roles: dict[str, TPRole], patterns: list[TPPattern],
                claim: Callable[[int, fx.Node, RoleKind, int], None]) -> None:
    """The token embedding (largest table) by rows, the LM head (vocabulary-wide linear) by columns."""
    tables = [(n, _table_rows(gm, n)) for n in nodes if _name(n) in _EMBEDDING]
    tables = [(n, rows) for n, rows in tables if rows]
    if not tables:
        return
    vocab = max(rows for _, rows in tables)
    weight = {captured.parameter_names.get(p, p) for n, rows in tables if rows == vocab
              for p in node_parameters(gm, n)}
    for n, rows in tables:
        if rows == vocab and n.name not in roles:
            patterns.append(TPPattern("embedding", (n.name,), n.name, n.name, vocab))
            claim(len(patterns) - 1, n, "embedding", vocab)
    for n in nodes:
        if n not in linears or n.name in roles or _last(n) != vocab:
            continue
        tied = {captured.parameter_names.get(p, p) for p in node_parameters(gm, n)} & weight
        source = _activation(n)
        if source is None or (not tied and _last(source) == vocab):
            continue
        index = len(patterns)
        patterns.append(TPPattern("head", (n.name,), None, source.name, vocab, hidden=_last(source) or 0))
        claim(index, n, "head", vocab)
        stack = list(n.users)
        while stack:  # the logits and what a vocabulary-parallel loss computes from them
            u = stack.pop()
            if u.name in roles or u.meta.get(KIND_KEY) != "compute":
                continue
            if _name(u) in _LOSS:
                roles[u.name] = TPRole(index, "vocab", vocab)
                continue
            if _name(u) in _ALLOWED and _last(u) == vocab:
                roles[u.name] = TPRole(index, "vocab", vocab)
                stack.extend(u.users)


# ------------------------------------------------------------------ node helpers


def _name(node: fx.Node) -> str:
    """The op's name without overload or namespace: ``aten.linear.default`` -> ``linear``; a module's class."""
    if node.op == "call_module":
        sub = node.graph.owning_module.get_submodule(str(node.target)) if node.graph.owning_module else None
        return type(sub).__name__.lower() if sub is not None else ""
    if node.op == "call_method":
        return str(node.target)
    if node.op != "call_function":
        return ""
    name = getattr(node.target, "__name__", str(node.target))
    return name.split(".")[0]


def _is_linear(gm: fx.GraphModule, node: fx.Node) -> bool:
    name = _name(node)
    if node.op == "call_module":
        return name in _LINEAR_MODULES and _matrix_parameter(gm, node)
    return name in _LINEAR and _matrix_parameter(gm, node) and _activation(node) is not None


def _matrix_parameter(gm: fx.GraphModule, node: fx.Node) -> bool:
    return any(_param_dim(gm, p) == 2 for p in node_parameters(gm, node))


def _param_dim(gm: fx.GraphModule, name: str) -> int:
    try:
        return int(gm.get_parameter(name).dim())
    except AttributeError:
        return -1


def _is_bias(gm: fx.GraphModule, node: fx.Node, name: str) -> bool:
    return _param_dim(gm, name) == 1


def _table_rows(gm: fx.GraphModule, node: fx.Node) -> int:
    for p in node_parameters(gm, node):
        if _param_dim(gm, p) == 2:
            return int(gm.get_parameter(p).shape[0])
    return 0


def _activation(node: fx.Node) -> fx.Node | None:
    """The one compute-made tensor a linear reads (not a parameter), if exactly one."""
    found = [a for a in node.all_input_nodes if a.meta.get(KIND_KEY) in ("compute", "input")
             and _info(a).kind == "tensor"]
    return found[0] if len(found) == 1 else None


def _info(node: fx.Node) -> ValueInfo:
    info = node.meta.get(VALUE_KEY)
    return info if isinstance(info, ValueInfo) else ValueInfo("none")


def _last(node: fx.Node) -> int | None:
    info = _info(node)
    return info.shape[-1] if info.kind == "tensor" and info.shape else None


def _width(node: fx.Node) -> int | None:
    return _last(node)


def _numel(node: fx.Node) -> int | None:
    info = _info(node)
    if info.kind != "tensor":
        return None
    total = 1
    for d in info.shape:
        total *= d
    return total
