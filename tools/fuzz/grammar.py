"""The fuzzer's grammar: a seeded generator of model specifications and layouts (plain data, no torch).

A :class:`ModelSpec` describes one small model as a family (``seq``: token or
feature sequences, ``(B, T, W)`` hidden states; ``conv``: images, ``(B, C, H, W)``),
its inputs, a list of :class:`Block` s drawn from :data:`SEQ_BLOCKS` or
:data:`CONV_BLOCKS`, skips between blocks, a head and extras (a reused module,
a dict output, a counter buffer).  :func:`generate` draws one from a seed;
:func:`sample_layout` draws the :class:`Layout` it is planned under (pp, dp, tp,
schedule, micro-batches, shard, recompute) from the same seed.  Both use only
``random.Random(seed)``-style streams, so a seed reproduces a case exactly; the
spec is JSON (``to_json`` / ``spec_from_json``) so a logged case can be rebuilt.
:func:`patterns` names the :data:`PATTERNS` a spec exercises (NNSmith-style
coverage: Liu et al., ASPLOS 2023).

Example (run from the repository root)::

    >>> spec = generate(7)
    >>> spec == generate(7) and spec_from_json(spec.to_json()) == spec
    True
    >>> sample_layout(7, spec).gpus <= 4
    True
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Sequence
from typing import Any

__all__ = [
    "CONV_BLOCKS",
    "MAX_GPUS",
    "PATTERNS",
    "SCHEDULES",
    "SEQ_BLOCKS",
    "Block",
    "Case",
    "Layout",
    "ModelSpec",
    "case_from_json",
    "generate",
    "make_case",
    "patterns",
    "sample_layout",
    "spec_from_json",
    "square_weight_blocks",
    "tp_able",
]

MAX_GPUS = 4  # CPU ranks per case
SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zbv", "auto")

# Every pattern the grammar can produce (the brief's list); ``patterns(spec)`` names those a spec uses.
PATTERNS = (
    "linear",             # nn.Linear + activation blocks
    "mlp",                # layer norm -> up -> act -> down, residual (a tensor-parallel pair)
    "layernorm",          # nn.LayerNorm blocks and the final norm
    "attention",          # q/k/v projections, softmax(q k^T) v (or SDPA), output projection
    "fused_qkv",          # one qkv projection, viewed (B, T, 3, H, D) or split along the width
    "conv_bn",            # Conv2d + BatchNorm2d (+ ReLU, residual)
    "batchnorm",          # BatchNorm running statistics updated in forward
    "reused_module",      # one module applied at several depths (ALBERT-style)
    "functional_weight",  # a module's weight read by F.linear / F.conv2d elsewhere (incl. the LM head)
    "matmul_weight",      # h @ w.T with w a Parameter (read again elsewhere or by the head)
    "tied_alias",         # a.weight = b.weight
    "inplace_op",         # mul_, relu_, add_, +=, ReLU(inplace=True) on activations
    "inplace_view",       # y[:, 0].mul_(...) on a view of an activation
    "inplace_input",      # a model input written in place
    "skip",               # a value used several blocks later
    "several_inputs",     # a second input (features joined late, or a mask)
    "dict_output",        # outputs as a dict, an early value among them
    "buffer_update",      # a buffer written in forward (EMA, BatchNorm, counter)
    "counter_buffer",     # an integer counter buffer incremented every forward
    "scale_buffer",       # a constant buffer read in forward
    "dropout",            # nn.Dropout / F.dropout
    "integer_inputs",     # token ids -> nn.Embedding
    "lm_head",            # embedding + LM head over the vocabulary (tied, functional, matmul or untied)
    "position_parameter", # a Parameter added to the embeddings (read through get_attr)
)

# name -> weight: blocks of the sequence family ("shared" only where the model has a shared module,
# "aux_join" only with a second feature input).
SEQ_BLOCKS: dict[str, float] = {
    "linear": 3.0, "mlp": 3.0, "layernorm": 1.0, "attention": 2.0, "fused_qkv": 1.5, "shared": 3.0,
    "fweight": 2.0, "matmul": 1.5, "tied": 1.5, "inplace": 2.5, "dropout": 1.5, "ema": 1.0, "scale": 1.0,
    "aux_join": 2.0,
}
CONV_BLOCKS: dict[str, float] = {
    "convbn": 3.0, "resblock": 2.0, "shared": 3.0, "fweight": 2.0, "inplace": 2.5, "dropout": 1.0, "ema": 1.0,
    "scale": 1.0, "aux_join": 2.0,
}
_ACTS = ("tanh", "gelu", "relu", "silu")
_SEQ_INPLACE = ("mul_", "view_mul_", "relu_", "iadd")
_CONV_INPLACE = ("relu_module", "view_mul_", "mul_", "iadd")


@dataclasses.dataclass(frozen=True)
class Block:
    """One block of the trunk: its stable id (names ``b{id}``), kind and options (JSON values)."""

    id: int
    kind: str
    opts: tuple[tuple[str, Any], ...] = ()

    def opt(self, key: str, default: Any = None) -> Any:
        return dict(self.opts).get(key, default)


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """One generated model (see the module docstring); :mod:`tools.fuzz.build` renders it as a model file."""

    seed: int
    family: str  # "seq" | "conv"
    inputs: str  # "tokens" | "features" | "image"
    width: int  # hidden width (seq) or channels (conv)
    blocks: tuple[Block, ...]
    skips: tuple[tuple[int, int], ...] = ()  # (source block id, destination block id): h after src added before dst
    aux: str = ""  # "" | "aux" (a float input joined by an aux_join block) | "mask" (seq: multiplies h)
    aux_inplace: bool = False  # the second input is written in place at the start of forward
    shared: str = ""  # "" | "linear" | "mlp" | "conv": a module applied by every "shared" block
    pos_emb: bool = False  # seq: a (T, W) Parameter added after the stem
    final_norm: bool = False  # seq: a LayerNorm before the head
    head: str = "classify"  # tokens: alias|functional|matmul|untied; features: classify|regress; conv: classify
    dict_output: bool = False
    counter: bool = False
    sabotage: str = ""  # tests only, never generated: "grad" scales one gradient on CPU ranks; "crash" fails there
    seq_len: int = 4
    vocab: int = 16
    heads: int = 2
    classes: int = 4
    aux_width: int = 6
    size: int = 6  # conv: image height and width

    def to_json(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["blocks"] = [{"id": b.id, "kind": b.kind, "opts": dict(b.opts)} for b in self.blocks]
        data["skips"] = [list(s) for s in self.skips]
        return data

    def block(self, block_id: int) -> Block:
        return next(b for b in self.blocks if b.id == block_id)


@dataclasses.dataclass(frozen=True)
class Layout:
    """How a case is planned: ``gpus = pp x dp x tp`` CPU ranks and the planner's other choices."""

    pp: int
    dp: int
    tp: int
    schedule: str
    microbatches: int | str  # a count or "auto"
    shard: str  # none | optimizer | full
    recompute: str  # none | full | auto

    @property
    def gpus(self) -> int:
        return self.pp * self.dp * self.tp

    def label(self) -> str:
        return (f"pp{self.pp} dp{self.dp} tp{self.tp} {self.schedule} M{self.microbatches} "
                f"shard {self.shard} recompute {self.recompute}")

    def cli_flags(self) -> str:
        """The planning command's flags for this layout (``autopartition model.py ...``)."""
        return (f"--gpus {self.gpus} --pp {self.pp} --dp {self.dp} --tp {self.tp} --schedule {self.schedule} "
                f"--microbatches {self.microbatches} --shard {self.shard} --recompute {self.recompute}")


@dataclasses.dataclass(frozen=True)
class Case:
    """A seed's model and layout."""

    seed: int
    spec: ModelSpec
    layout: Layout

    def to_json(self) -> dict[str, Any]:
        return {"seed": self.seed, "spec": self.spec.to_json(), "layout": dataclasses.asdict(self.layout)}


def spec_from_json(data: dict[str, Any]) -> ModelSpec:
    """The inverse of :meth:`ModelSpec.to_json`."""
    fields = dict(data)
    fields["blocks"] = tuple(Block(b["id"], b["kind"], tuple(sorted(b["opts"].items()))) for b in data["blocks"])
    fields["skips"] = tuple((int(a), int(b)) for a, b in data["skips"])
    return ModelSpec(**fields)


def case_from_json(data: dict[str, Any]) -> Case:
    """A logged case (``Case.to_json``, as in the fuzzer's JSON lines) rebuilt."""
    return Case(int(data["seed"]), spec_from_json(data["spec"]), Layout(**data["layout"]))


def make_case(seed: int) -> Case:
    """The case of ``seed``: its model and its layout."""
    spec = generate(seed)
    return Case(seed, spec, sample_layout(seed, spec))


# ------------------------------------------------------------------ generation


def _weighted(rng: random.Random, table: dict[str, float], allowed: Sequence[str]) -> str:
    names = [n for n in table if n in allowed]
    return rng.choices(names, weights=[table[n] for n in names])[0]


def _opts(**kwargs: Any) -> tuple[tuple[str, Any], ...]:
    return tuple(sorted(kwargs.items()))


def square_weight_blocks(blocks: Sequence[Block], family: str) -> list[Block]:
    """Blocks owning a module whose weight another block may read (W x W linear; C x C x 3 x 3 conv)."""
    kinds = ("linear", "tied", "inplace") if family == "seq" else ("convbn", "resblock", "inplace")
    return [b for b in blocks if b.kind in kinds]


def _block(rng: random.Random, kind: str, block_id: int, family: str, before: Sequence[Block]) -> Block:
    """One block of ``kind`` with random options; references point only at blocks ``before`` it."""
    square = square_weight_blocks(before, family)
    if kind == "linear":
        return Block(block_id, kind, _opts(act=rng.choice(_ACTS), residual=rng.random() < 0.6))
    if kind == "mlp":
        return Block(block_id, kind, _opts(act=rng.choice(_ACTS), norm=rng.random() < 0.7))
    if kind == "attention":
        return Block(block_id, kind, _opts(causal=rng.random() < 0.5, sdpa=rng.random() < 0.3))
    if kind == "fused_qkv":
        return Block(block_id, kind, _opts(style=rng.choice(("view5", "split")), causal=rng.random() < 0.5))
    if kind == "shared":
        return Block(block_id, kind, _opts(residual=rng.random() < 0.7))
    if kind == "fweight":  # another block's weight read functionally; the shared module's when none
        ref = rng.choice(square).id if square else -1
        return Block(block_id, kind, _opts(ref=ref, bias=rng.random() < 0.5))
    if kind == "matmul":
        mats = [b for b in before if b.kind == "matmul" and b.opt("ref", -1) < 0]
        ref = rng.choice(mats).id if mats and rng.random() < 0.6 else -1
        return Block(block_id, kind, _opts(ref=ref, act=rng.choice(_ACTS)))
    if kind == "tied":
        lins = [b for b in square if b.kind in ("linear", "inplace")]
        return Block(block_id, kind, _opts(ref=rng.choice(lins).id if lins else -1, act=rng.choice(_ACTS)))
    if kind == "inplace":
        return Block(block_id, kind, _opts(variant=rng.choice(_SEQ_INPLACE if family == "seq" else _CONV_INPLACE)))
    if kind == "dropout":
        return Block(block_id, kind, _opts(functional=rng.random() < 0.5, p=rng.choice((0.1, 0.2, 0.5))))
    if kind == "convbn":
        return Block(block_id, kind, _opts(relu_inplace=rng.random() < 0.5))
    return Block(block_id, kind)  # layernorm, ema, scale, aux_join, resblock: no options


def generate(seed: int) -> ModelSpec:
    """The model of ``seed``: valid by construction (shapes agree, references point backwards)."""
    rng = random.Random(f"autopartition-fuzz-model-{seed}")
    family = "conv" if rng.random() < 0.3 else "seq"
    if family == "seq":
        inputs = "tokens" if rng.random() < 0.6 else "features"
        width = 8 if rng.random() < 0.7 else 16
        aux = rng.choices(("", "aux", "mask"), weights=(5, 3, 2))[0]
        shared = rng.choice(("linear", "mlp")) if rng.random() < 0.35 else ""
        head = (rng.choices(("alias", "functional", "matmul", "untied"), weights=(3, 3, 2, 2))[0]
                if inputs == "tokens" else rng.choice(("classify", "regress")))
        table = SEQ_BLOCKS
    else:
        inputs, width, head, table = "image", 4, "classify", CONV_BLOCKS
        aux = "aux" if rng.random() < 0.4 else ""
        shared = "conv" if rng.random() < 0.35 else ""
    aux_inplace = bool(aux) and rng.random() < 0.4
    allowed = [k for k in table if (k != "shared" or shared) and (k != "aux_join" or aux == "aux")]
    depth = rng.randint(2, 7)
    blocks: list[Block] = []
    for i in range(depth):
        kind = _weighted(rng, table, allowed)
        if kind == "aux_join" and any(b.kind == "aux_join" for b in blocks):
            kind = "linear" if family == "seq" else "convbn"
        blocks.append(_block(rng, kind, i, family, blocks))
    if shared and sum(b.kind == "shared" for b in blocks) < 2:  # a reused module is used at least twice
        for _ in range(2 - sum(b.kind == "shared" for b in blocks)):
            blocks.insert(rng.randint(0, len(blocks)), _block(rng, "shared", len(blocks), family, []))
    if aux == "aux" and not any(b.kind == "aux_join" for b in blocks):
        blocks.insert(rng.randint(1, len(blocks)), Block(len(blocks), "aux_join"))
    skips: list[tuple[int, int]] = []
    if len(blocks) >= 3 and rng.random() < 0.5:
        for _ in range(rng.randint(1, 2)):
            src = rng.randrange(0, len(blocks) - 2)
            dst = rng.randrange(src + 2, len(blocks))
            pair = (blocks[src].id, blocks[dst].id)
            if pair not in skips:
                skips.append(pair)
    return ModelSpec(
        seed=seed, family=family, inputs=inputs, width=width, blocks=tuple(blocks), skips=tuple(skips), aux=aux,
        aux_inplace=aux_inplace, shared=shared, pos_emb=family == "seq" and rng.random() < 0.4,
        final_norm=family == "seq" and rng.random() < 0.5, head=head, dict_output=rng.random() < 0.3,
        counter=rng.random() < 0.25,
    )


def tp_able(spec: ModelSpec) -> bool:
    """Whether the model has layers tensor parallelism splits (column/row pairs, a vocabulary)."""
    kinds = {b.kind for b in spec.blocks}
    return spec.family == "seq" and (
        bool(kinds & {"mlp", "attention", "fused_qkv"}) or spec.shared == "mlp" or spec.inputs == "tokens")


def sample_layout(seed: int, spec: ModelSpec) -> Layout:
    """The layout ``seed``'s model is planned under: at most :data:`MAX_GPUS` ranks."""
    rng = random.Random(f"autopartition-fuzz-layout-{seed}")
    schedule = rng.choice(SCHEDULES)
    pp = rng.choices((1, 2, 3, 4), weights=(1, 5, 1.5, 2.5))[0]
    tp = 2 if pp * 2 <= MAX_GPUS and rng.random() < (0.35 if tp_able(spec) else 0.05) else 1
    dp = 2 if pp * tp * 2 <= MAX_GPUS and rng.random() < 0.5 else 1
    shard = rng.choice(("none", "optimizer", "full")) if dp > 1 else "none"
    recompute = rng.choices(("none", "full", "auto"), weights=(4, 2.5, 3.5))[0]
    if recompute == "full" and schedule in ("zb-h1", "zbv") and rng.random() < 0.75:
        recompute = rng.choice(("none", "auto"))  # mostly not the pair the planner refuses up front
    per_replica = 8 // dp
    counts = [m for m in range(1, per_replica + 1) if per_replica % m == 0]
    if schedule == "interleaved-1f1b" and rng.random() < 0.85:  # rounds of pp micro-batches
        counts = [m for m in counts if m % pp == 0] or counts
    microbatches: int | str = "auto" if rng.random() < 0.2 else rng.choice(counts)
    return Layout(pp=pp, dp=dp, tp=tp, schedule=schedule, microbatches=microbatches, shard=shard,
                  recompute=recompute)


def patterns(spec: ModelSpec) -> set[str]:
    """The :data:`PATTERNS` this spec exercises."""
    kinds = [b.kind for b in spec.blocks]
    found: set[str] = set()
    direct = {"linear": "linear", "mlp": "mlp", "layernorm": "layernorm", "attention": "attention",
              "fused_qkv": "fused_qkv", "dropout": "dropout", "ema": "buffer_update",
              "scale": "scale_buffer", "matmul": "matmul_weight", "fweight": "functional_weight",
              "convbn": "conv_bn", "resblock": "conv_bn", "shared": "reused_module"}
    found |= {direct[k] for k in kinds if k in direct}
    if spec.final_norm or spec.shared == "mlp" or any(b.kind == "mlp" and b.opt("norm") for b in spec.blocks):
        found.add("layernorm")  # the shared MLP opens with its own norm
    if spec.shared == "mlp":
        found.add("mlp")
    if spec.family == "conv":
        found |= {"conv_bn", "batchnorm", "buffer_update"}
    for b in spec.blocks:
        if b.kind == "tied" and b.opt("ref") >= 0:
            found.add("tied_alias")
        if b.kind == "inplace":
            found.add("inplace_view" if b.opt("variant") == "view_mul_" else "inplace_op")
        if b.kind == "convbn" and b.opt("relu_inplace"):
            found.add("inplace_op")
    if spec.aux_inplace:
        found.add("inplace_input")
    if spec.skips:
        found.add("skip")
    if spec.aux:
        found.add("several_inputs")
    if spec.dict_output:
        found.add("dict_output")
    if spec.counter:
        found |= {"counter_buffer", "buffer_update"}
    if spec.inputs == "tokens":
        found |= {"integer_inputs", "lm_head"}
        if spec.head == "alias":
            found.add("tied_alias")
        if spec.head == "functional":
            found.add("functional_weight")
        if spec.head == "matmul":
            found.add("matmul_weight")
    if spec.pos_emb:
        found.add("position_parameter")
    return found
