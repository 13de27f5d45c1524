"""Render a :class:`~tools.fuzz.grammar.ModelSpec` as a model file: a real Python class, no fuzzer imports.

:func:`render` returns the source of a model file following DESIGN.md's convention
(``build_model()``, ``example_inputs(batch_size)``, ``example_target(batch_size)``,
``loss_fn(outputs, target)``), a standalone file a failing case is kept as;
:func:`write_model_file` writes a case's file (its layout and the commands that
reproduce it in the docstring); :func:`build` imports the rendered source and
returns the model file's namespace (for tests that need no file on disk).

Example (run from the repository root)::

    >>> from tools.fuzz.grammar import generate
    >>> namespace = build(generate(3))
    >>> model = namespace["build_model"]()
    >>> loss = namespace["loss_fn"](model(*namespace["example_inputs"](8)), namespace["example_target"](8))
    >>> loss.dim()
    0
"""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

from tools.fuzz.grammar import Block, Case, ModelSpec, patterns

__all__ = ["BATCH", "build", "render", "write_model_file"]

BATCH = 8  # samples per mini-batch of every case
_FEATURES = 5  # features per position of a "features" input
_OUT = 3  # regression outputs per position

_ACT = {"tanh": "torch.tanh({})", "gelu": "F.gelu({})", "relu": "F.relu({})", "silu": "F.silu({})"}


def _act(name: str, expr: str) -> str:
    return _ACT[name].format(expr)


class _Source:
    """Lines of ``__init__`` and ``forward`` being written, and helper classes the model needs."""

    def __init__(self) -> None:
        self.init: list[str] = []
        self.forward: list[str] = []
        self.helpers: list[str] = []

    def i(self, *lines: str) -> None:
        self.init.extend(lines)

    def f(self, *lines: str) -> None:
        self.forward.extend(lines)


def _weight_module(spec: ModelSpec, block: Block) -> str:
    """The module (``self.<name>``) whose square weight a block owns, for another block to read."""
    if spec.family == "conv" and block.kind in ("convbn", "resblock"):
        return f"self.b{block.id}_conv"
    return f"self.b{block.id}"


def _attention(s: _Source, name: str, q: str, k: str, v: str, *, causal: bool, sdpa: bool) -> None:
    """Head-split q, k, v (B, H, T, D) -> h += out(attention)."""
    if sdpa:
        s.f(f"y = F.scaled_dot_product_attention({q}, {k}, {v}, is_causal={causal})")
    else:
        s.f(f"att = ({q} @ {k}.transpose(-2, -1)) * HEAD_DIM ** -0.5  # (B, H, T, T)")
        if causal:
            s.i(f'self.register_buffer("{name}_mask", torch.tril(torch.ones(SEQ, SEQ, dtype=torch.bool)), '
                "persistent=False)")
            s.f(f'att = att.masked_fill(~self.{name}_mask, float("-inf"))  # causal (T = SEQ)')
        s.f(f"y = att.softmax(dim=-1) @ {v}  # (B, H, T, D)")
    s.f("y = y.transpose(1, 2).reshape(h.size(0), h.size(1), WIDTH)", f"h = h + self.{name}_o(y)")


def _heads(expr: str) -> str:
    return f"{expr}.view(h.size(0), h.size(1), HEADS, HEAD_DIM).transpose(1, 2)"


def _seq_block(s: _Source, spec: ModelSpec, b: Block) -> None:
    n = f"b{b.id}"
    kind = b.kind
    if kind == "linear":
        s.i(f"self.{n} = nn.Linear(WIDTH, WIDTH)")
        y = _act(b.opt("act"), f"self.{n}(h)")
        s.f(f"h = h + {y}" if b.opt("residual") else f"h = {y}")
    elif kind == "mlp":
        if b.opt("norm"):
            s.i(f"self.{n}_ln = nn.LayerNorm(WIDTH)")
        s.i(f"self.{n}_up = nn.Linear(WIDTH, 2 * WIDTH)", f"self.{n}_down = nn.Linear(2 * WIDTH, WIDTH)")
        x = f"self.{n}_ln(h)" if b.opt("norm") else "h"
        s.f(f"h = h + self.{n}_down({_act(b.opt('act'), f'self.{n}_up({x})')})")
    elif kind == "layernorm":
        s.i(f"self.{n} = nn.LayerNorm(WIDTH)")
        s.f(f"h = self.{n}(h)")
    elif kind == "attention":
        s.i(*(f"self.{n}_{p} = nn.Linear(WIDTH, WIDTH)" for p in "qkvo"))
        s.f(*(f"{p} = {_heads(f'self.{n}_{p}(h)')}  # (B, H, T, D)" for p in "qkv"))
        _attention(s, n, "q", "k", "v", causal=b.opt("causal"), sdpa=b.opt("sdpa"))
    elif kind == "fused_qkv":
        s.i(f"self.{n}_qkv = nn.Linear(WIDTH, 3 * WIDTH)", f"self.{n}_o = nn.Linear(WIDTH, WIDTH)")
        if b.opt("style") == "view5":
            s.f(f"qkv = self.{n}_qkv(h).view(h.size(0), h.size(1), 3, HEADS, HEAD_DIM).permute(2, 0, 3, 1, 4)",
                "q, k, v = qkv[0], qkv[1], qkv[2]  # (B, H, T, D) each")
        else:
            s.f(f"q, k, v = self.{n}_qkv(h).split(WIDTH, dim=-1)",
                *(f"{p} = {_heads(p)}" for p in "qkv"))
        _attention(s, n, "q", "k", "v", causal=b.opt("causal"), sdpa=False)
    elif kind == "shared":
        y = "torch.tanh(self.shared(h))" if spec.shared == "linear" else "self.shared(h)"
        s.f(f"h = h + {y}" if b.opt("residual") else f"h = {y}")
    elif kind == "fweight":
        if b.opt("ref") >= 0:
            w = _weight_module(spec, spec.block(b.opt("ref")))
        else:  # its own layer, read through the functional
            s.i(f"self.{n} = nn.Linear(WIDTH, WIDTH, bias={bool(b.opt('bias'))})")
            w = f"self.{n}"
        bias = f", {w}.bias" if b.opt("bias") else ""
        s.f(f"h = h + torch.tanh(F.linear(h, {w}.weight{bias}))")
    elif kind == "matmul":
        ref = b.opt("ref")
        if ref >= 0:
            y = _act(b.opt("act"), f"h @ self.b{ref}")
            s.f(f"h = h + {y}  # block {ref}'s matrix, read again (untransposed)")
        else:
            s.i(f"self.{n} = nn.Parameter(0.3 * torch.randn(WIDTH, WIDTH))")
            s.f(f"h = h + {_act(b.opt('act'), f'h @ self.{n}.T')}")
    elif kind == "tied":
        s.i(f"self.{n} = nn.Linear(WIDTH, WIDTH)")
        if b.opt("ref") >= 0:
            s.i(f"self.{n}.weight = {_weight_module(spec, spec.block(b.opt('ref')))}.weight  # tied alias")
        s.f(f"h = h + {_act(b.opt('act'), f'self.{n}(h)')}")
    elif kind == "inplace":
        s.i(f"self.{n} = nn.Linear(WIDTH, WIDTH)")
        _inplace(s, n, b.opt("variant"))
    else:
        _common_block(s, spec, b)


def _inplace(s: _Source, n: str, variant: str) -> None:
    if variant == "relu_module":
        s.i(f"self.{n}_act = nn.ReLU(inplace=True)")
        s.f(f"h = h + self.{n}_act(self.{n}(h))")
    elif variant == "mul_":
        s.f(f"y = self.{n}(h)", "y.mul_(0.5)", "h = h + torch.tanh(y)")
    elif variant == "view_mul_":
        s.f(f"y = self.{n}(h)", "y[:, 0].mul_(2.0)  # in place on a view", "h = h + torch.tanh(y)")
    elif variant == "relu_":
        s.f(f"y = self.{n}(h)", "h = h + torch.relu_(y)")
    elif variant == "iadd":
        s.f(f"y = self.{n}(h)", "y += h", "h = torch.tanh(y)")
    else:
        raise ValueError(f"unknown in-place variant {variant!r}")


def _common_block(s: _Source, spec: ModelSpec, b: Block) -> None:
    """Blocks both families share: dropout, buffers, the second input."""
    n = f"b{b.id}"
    conv = spec.family == "conv"
    if b.kind == "dropout":
        if b.opt("functional"):
            s.f(f"h = F.dropout(h, p={b.opt('p')}, training=self.training)")
        else:
            s.i(f"self.{n} = nn.Dropout({b.opt('p')})")
            s.f(f"h = self.{n}(h)")
    elif b.kind == "ema":  # a running mean written in forward
        s.i(f'self.register_buffer("{n}", torch.zeros(WIDTH))')
        dims, shape = ("(0, 2, 3)", ".view(1, -1, 1, 1)") if conv else ("(0, 1)", "")
        s.f(f"self.{n}.mul_(0.9).add_(0.1 * h.detach().mean(dim={dims}))", f"h = h - self.{n}{shape}")
    elif b.kind == "scale":
        s.i(f'self.register_buffer("{n}", torch.linspace(0.5, 1.5, WIDTH){".view(-1, 1, 1)" if conv else ""})')
        s.f(f"h = h * self.{n}")
    elif b.kind == "aux_join":
        s.i(f"self.{n} = nn.Conv2d(3, WIDTH, 1)" if conv else f"self.{n} = nn.Linear(AUX_WIDTH, WIDTH)")
        s.f(f"h = h + self.{n}(aux)  # the second input, joined here")
    else:
        raise ValueError(f"unknown {spec.family} block kind {b.kind!r}")


def _conv_block(s: _Source, spec: ModelSpec, b: Block) -> None:
    n = f"b{b.id}"
    if b.kind in ("convbn", "resblock"):
        s.i(f"self.{n}_conv = nn.Conv2d(WIDTH, WIDTH, 3, padding=1, bias=False)", f"self.{n}_bn = nn.BatchNorm2d(WIDTH)")
        y = f"self.{n}_bn(self.{n}_conv(h))"
        if b.kind == "resblock":
            s.f(f"h = F.relu(h + {y})")
        elif b.opt("relu_inplace"):
            s.i(f"self.{n}_act = nn.ReLU(inplace=True)")
            s.f(f"h = self.{n}_act({y})")
        else:
            s.f(f"h = F.relu({y})")
    elif b.kind == "shared":
        s.f("h = h + torch.tanh(self.shared(h))" if b.opt("residual") else "h = torch.tanh(self.shared(h))")
    elif b.kind == "fweight":
        if b.opt("ref") >= 0:
            w = _weight_module(spec, spec.block(b.opt("ref")))
            bias = f", {w}.bias" if b.opt("bias") and spec.block(b.opt("ref")).kind == "inplace" else ""
        else:
            s.i(f"self.{n} = nn.Conv2d(WIDTH, WIDTH, 3, padding=1, bias={bool(b.opt('bias'))})")
            w, bias = f"self.{n}", f", self.{n}.bias" if b.opt("bias") else ""
        s.f(f"h = h + torch.tanh(F.conv2d(h, {w}.weight{bias}, padding=1))")
    elif b.kind == "inplace":
        s.i(f"self.{n} = nn.Conv2d(WIDTH, WIDTH, 3, padding=1)")
        _inplace(s, n, b.opt("variant"))
    else:
        _common_block(s, spec, b)


_SHARED_MLP = '''
class MLP(nn.Module):
    """Norm, up, GELU, down: one layer module the model applies at several depths."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(width)
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)

    def forward(self, h: Tensor) -> Tensor:
        return self.down(F.gelu(self.up(self.ln(h))))
'''


def _input_names(spec: ModelSpec) -> list[str]:
    first = {"tokens": "tokens", "features": "x", "image": "image"}[spec.inputs]
    return [first] + ([spec.aux] if spec.aux else [])


def _body(spec: ModelSpec) -> _Source:
    s = _Source()
    if spec.sabotage == "crash":
        s.f('if torch.distributed.is_initialized():  # sabotage: fail on the ranks only',
            '    raise RuntimeError("sabotaged: this model fails on CPU ranks")')
    if spec.aux_inplace:
        s.f(f"{spec.aux}.mul_(0.5)  # an input written in place")
    if spec.family == "seq":
        if spec.inputs == "tokens":
            s.i("self.emb = nn.Embedding(VOCAB, WIDTH)")
            s.f("h = self.emb(tokens)  # (B, T, W)")
        else:
            s.i("self.proj = nn.Linear(FEATURES, WIDTH)")
            s.f("h = self.proj(x)  # (B, T, W)")
        if spec.pos_emb:
            s.i("self.pos = nn.Parameter(0.1 * torch.randn(SEQ, WIDTH))")
            s.f("h = h + self.pos")
        if spec.aux == "mask":
            s.f("h = h * mask.unsqueeze(-1)")
        if spec.shared == "linear":
            s.i("self.shared = nn.Linear(WIDTH, WIDTH)  # applied by several blocks")
        elif spec.shared == "mlp":
            s.i("self.shared = MLP(WIDTH)  # applied by several blocks")
            s.helpers.append(_SHARED_MLP)
    else:
        s.i("self.stem = nn.Conv2d(3, WIDTH, 3, padding=1, bias=False)", "self.stem_bn = nn.BatchNorm2d(WIDTH)")
        s.f("h = F.relu(self.stem_bn(self.stem(image)))  # (B, C, H, W)")
        if spec.shared:
            s.i("self.shared = nn.Conv2d(WIDTH, WIDTH, 3, padding=1)  # applied by several blocks")
    if spec.dict_output:
        s.f("early = h")
    for b in spec.blocks:
        for src, dst in spec.skips:
            if dst == b.id:
                s.f(f"h = h + keep{src}  # a skip from block {src}")
        s.f(f"# block {b.id}: {b.kind}")
        (_seq_block if spec.family == "seq" else _conv_block)(s, spec, b)
        if any(src == b.id for src, _ in spec.skips):
            s.f(f"keep{b.id} = h")
    _head(s, spec)
    if spec.counter:
        s.i('self.register_buffer("calls", torch.zeros((), dtype=torch.long))')
        s.f("self.calls.add_(1)  # a counter buffer")
    if spec.sabotage == "grad":
        s.i("first = next(self.parameters())",
            "first.register_hook(lambda g: g * 1.5 if torch.distributed.is_initialized() else g)  # sabotage")
    if spec.dict_output:
        early = "early.mean(dim=-1)" if spec.family == "seq" else "early.mean(dim=1)"
        s.f(f'return {{"logits": logits, "early": {early}}}')
    else:
        s.f("return logits")
    return s


def _head(s: _Source, spec: ModelSpec) -> None:
    if spec.final_norm:
        s.i("self.ln_f = nn.LayerNorm(WIDTH)")
        s.f("h = self.ln_f(h)")
    head = spec.head
    if head == "alias":
        s.i("self.head = nn.Linear(WIDTH, VOCAB, bias=False)", "self.head.weight = self.emb.weight  # tied alias")
        s.f("logits = self.head(h)  # (B, T, V)")
    elif head == "functional":
        s.f("logits = F.linear(h, self.emb.weight)  # (B, T, V): the embedding read by the head")
    elif head == "matmul":
        s.f("logits = h @ self.emb.weight.T  # (B, T, V): the embedding read by the head")
    elif head == "untied":
        s.i("self.head = nn.Linear(WIDTH, VOCAB)")
        s.f("logits = self.head(h)  # (B, T, V)")
    elif head == "regress":
        s.i("self.head = nn.Linear(WIDTH, OUT)")
        s.f("logits = self.head(h)  # (B, T, OUT)")
    elif spec.family == "seq":
        s.i("self.head = nn.Linear(WIDTH, CLASSES)")
        s.f("logits = self.head(h.mean(dim=1))  # (B, CLASSES)")
    else:
        s.i("self.head = nn.Linear(WIDTH, CLASSES)")
        s.f("logits = self.head(h.mean(dim=(2, 3)))  # (B, CLASSES)")


def _data(spec: ModelSpec) -> str:
    """example_inputs, example_target and loss_fn."""
    inputs = {"tokens": "torch.randint(0, VOCAB, (batch_size, SEQ), generator=g)",
              "features": "torch.randn(batch_size, SEQ, FEATURES, generator=g)",
              "image": "torch.randn(batch_size, 3, SIZE, SIZE, generator=g)"}[spec.inputs]
    made = [inputs]
    if spec.aux == "aux":
        made.append("torch.randn(batch_size, 3, SIZE, SIZE, generator=g)" if spec.family == "conv"
                    else "torch.randn(batch_size, SEQ, AUX_WIDTH, generator=g)")
    elif spec.aux == "mask":
        made.append("(torch.rand(batch_size, SEQ, generator=g) > 0.3).float()")
    if spec.head in ("alias", "functional", "matmul", "untied"):
        target = "torch.randint(0, VOCAB, (batch_size, SEQ), generator=g)"
    elif spec.head == "regress":
        target = "torch.randn(batch_size, SEQ, OUT, generator=g)"
    else:
        target = "torch.randint(0, CLASSES, (batch_size,), generator=g)"
    loss = ("F.mse_loss(logits, target)" if spec.head == "regress"
            else "F.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1))")
    pick = 'logits = outputs["logits"]' if spec.dict_output else "logits = outputs"
    extra = '\n    loss = loss + 0.01 * outputs["early"].pow(2).mean()' if spec.dict_output else ""
    tuple_text = ", ".join(made) + ("," if len(made) == 1 else "")
    return f'''

def example_inputs(batch_size: int = BATCH) -> tuple[Tensor, ...]:
    g = torch.Generator().manual_seed(SEED)
    return ({tuple_text})


def example_target(batch_size: int = BATCH) -> Tensor:
    g = torch.Generator().manual_seed(SEED + 1)
    return {target}


def loss_fn(outputs: Any, target: Tensor) -> Tensor:
    {pick}
    loss = {loss}{extra}
    return loss
'''


def render(spec: ModelSpec, *, title: str = "", notes: str = "") -> str:
    """The model file of ``spec`` (its docstring opens with ``title``, then ``notes``)."""
    s = _body(spec)
    heading = title or f"A fuzzed model (tools/fuzz_models.py, seed {spec.seed})."
    found = ", ".join(sorted(patterns(spec)))
    doc = f"{heading}\n\nPatterns: {found}.\n" + (f"\n{notes.strip()}\n" if notes.strip() else "")
    args = ", ".join(f"{n}: Tensor" for n in _input_names(spec))
    returns = "dict[str, Tensor]" if spec.dict_output else "Tensor"
    init = textwrap.indent("\n".join(s.init), " " * 8)
    forward = textwrap.indent("\n".join(s.forward), " " * 8)
    constants = (f"SEED = {spec.seed}\nBATCH = {BATCH}\nSEQ = {spec.seq_len}\nWIDTH = {spec.width}\n"
                 f"VOCAB = {spec.vocab}\nHEADS = {spec.heads}\nHEAD_DIM = WIDTH // HEADS\n"
                 f"CLASSES = {spec.classes}\nFEATURES = {_FEATURES}\nAUX_WIDTH = {spec.aux_width}\n"
                 f"OUT = {_OUT}\nSIZE = {spec.size}\n")
    return f'''"""{doc}"""

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["FuzzNet", "build_model", "example_inputs", "example_target", "loss_fn"]

{constants}{"".join(s.helpers)}

class FuzzNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
{init}

    def forward(self, {args}) -> {returns}:
{forward}


def build_model() -> FuzzNet:
    torch.manual_seed(SEED)
    return FuzzNet()
{_data(spec)}'''


def write_model_file(case: Case, path: str | Path, *, title: str = "", notes: str = "",
                     from_seed: bool = True) -> Path:
    """Write ``case``'s model file to ``path``; its docstring names the layout and the commands to replay it.

    ``from_seed``: the case is its seed's own (not reduced or rewritten), so the fuzzer replays it too.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    layout = case.layout
    again = f"    .venv/bin/python tools/fuzz_models.py --seeds {case.seed}:{case.seed + 1}\n" if from_seed else ""
    replay = (f"Layout: {layout.label()}.\nReplay (from the repository root)::\n\n{again}"
              f"    .venv/bin/autopartition {path.name} {layout.cli_flags()} --batch-size {BATCH} --device h100 "
              "--out plan\n"
              f"    .venv/bin/autopartition verify plan --model {path.name}\n")
    path.write_text(render(case.spec, title=title, notes=f"{notes.strip()}\n\n{replay}" if notes else replay))
    return path


def build(spec: ModelSpec) -> dict[str, Any]:
    """The rendered model file's namespace (``build_model``, ``example_inputs``, ...), imported from memory."""
    namespace: dict[str, Any] = {"__name__": f"fuzz_model_{spec.seed}"}
    exec(compile(render(spec), f"<fuzz model {spec.seed}>", "exec"), namespace)  # noqa: S102 - our own source
    return namespace
