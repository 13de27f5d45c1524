"""Materialise a model built on ``meta``: only the tensors a rank holds, the same values however split.

A model file's ``build_model()`` may build on the meta device (shapes, no
memory).  Each rank then captures the model on meta, keeps its stage's nodes
and calls :func:`materialise_modules` on its stage modules: only the parameters
and buffers those modules hold are allocated on the rank's device.
:func:`materialise_model` does the same for a whole model (the single-process
reference of ``autopartition verify`` and of tests).

**Partition-invariant initialisation.**  Tensors are initialised per *owner*:
the submodule holding a tensor directly (``blocks.3.attn.c_attn`` owns
``blocks.3.attn.c_attn.weight``; a tied tensor belongs to its first owner in
``model.named_modules()`` order).  An owner is initialised on its own, on a
copy whose children are left on meta (so that what it writes to them is
dropped), with the random generator of the device seeded from
``(seed, owner name)`` by :func:`init_seed` (SHA-256, not Python's salted
``hash``).  The first of these that writes any of the owner's tensors wins:

1. the model file's ``init_weights(module, name)`` (``name``: the owner's
   qualified name), which initialises ``module``'s own parameters and buffers
   in place (or assigns new tensors), and does nothing for modules it leaves
   to the next steps;
2. for Hugging Face models, the model's own ``_init_weights(module)``
   (linear layers, embeddings, norms, rotary embeddings);
3. ``module.reset_parameters()`` (every ``torch.nn`` layer with parameters).

So a parameter gets the same values whether the whole model or one stage is
materialised, on any rank.  The global random state is left as it was
(``torch.random.fork_rng``, the CUDA generator of the device too).  Values
depend on the device type: CPU and CUDA generators draw different numbers.

**Buffers** computed in ``__init__`` (rotary ``inv_freq``, causal masks,
position ids) are handled like parameters, with one addition:

* a buffer that is *not* on meta (built with an explicit ``device=``, or a
  constant the capture baked in) is kept as it is (``Pipeline`` moves it to the
  device with the rest of the stage);
* a meta buffer is recomputed by its owner's initialisation above: Hugging
  Face rotary embeddings recompute ``inv_freq`` from their config in
  ``_init_weights``, torch's norms reset their running statistics in
  ``reset_parameters()``, and anything else (a ``torch.tril`` causal mask)
  needs the model file's ``init_weights``, e.g.::

      def init_weights(module, name):
          if isinstance(module, CausalSelfAttention):
              n = module.mask.shape[-1]
              module.mask = torch.ones(n, n, dtype=torch.bool).tril().view(1, 1, n, n)

A needed tensor that the step which wrote (or every step) leaves unwritten is
an error naming the module and the tensor.  An owner's new tensors start as NaN
(integers: their type's minimum), so writes through ``.data`` count as well.
``init_weights`` runs under ``torch.no_grad()`` with the device as the default
device, so new tensors it makes land where they are needed.

**Checkpoints.**  ``supply`` (a :data:`TensorSupply`) is asked first for every
tensor to materialise, by its name in the model (``model.state_dict()`` style,
the first name of a tied tensor), with a meta tensor of the expected shape and
dtype; what it returns is used (copied to the device and dtype), the rest is
initialised.

Graphs captured on meta by ``torch.export`` carry ``device="meta"`` literals
(``arange(..., device=meta)``); :func:`materialise_modules` points them at the
device.  A model without meta tensors is left exactly as it was.

Example::

    >>> import torch
    >>> with torch.device("meta"):
    ...     model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    >>> whole = materialise_model(model, seed=0)
    >>> with torch.device("meta"):
    ...     again = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    >>> materialise_modules(again, [again[0]], seed=0)  # one "stage": the first layer only
    >>> torch.equal(again[0].weight, whole[0].weight), again[1].weight.is_meta
    (True, True)
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import fx, nn
from torch.utils import _pytree as pytree

from partitioner.errors import ModelFileError

__all__ = [
    "InitWeights",
    "TensorSupply",
    "holds_meta",
    "init_seed",
    "materialise_model",
    "materialise_modules",
    "materialised_values",
]

InitWeights = Callable[[nn.Module, str], Any]
"""The model file's ``init_weights(module, name)``: initialise ``module``'s own tensors in place."""

TensorSupply = Callable[[Mapping[str, torch.Tensor]], Mapping[str, torch.Tensor]]
"""Given ``{name: meta tensor}`` to materialise, the real tensors it has (a checkpoint), by name."""

_META = torch.device("meta")


def init_seed(seed: int, name: str) -> int:
    """The generator seed of owner ``name`` under base ``seed``: stable across processes and runs.

    >>> init_seed(0, "blocks.0.attn") == init_seed(0, "blocks.0.attn") != init_seed(1, "blocks.0.attn")
    True
    """
    digest = hashlib.sha256(f"{seed}\0{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1  # a non-negative int64


def holds_meta(module: nn.Module) -> bool:
    """Does ``module`` hold a parameter or buffer on the meta device?"""
    return any(t.is_meta for t in _tensors(module))


def materialise_model(
    model: nn.Module,
    *,
    seed: int = 0,
    init_weights: InitWeights | None = None,
    device: torch.device | str = "cpu",
    supply: TensorSupply | None = None,
) -> nn.Module:
    """Every meta parameter and buffer of ``model`` made real on ``device``, in place; returns ``model``.

    The values equal those :func:`materialise_modules` gives any part of the model
    with the same ``seed`` and ``init_weights``.  Real tensors are not moved.
    """
    materialise_modules(model, [model], seed=seed, init_weights=init_weights, device=device, supply=supply)
    return model


def materialise_modules(
    model: nn.Module,
    holders: Sequence[nn.Module],
    *,
    seed: int = 0,
    init_weights: InitWeights | None = None,
    device: torch.device | str = "cpu",
    supply: TensorSupply | None = None,
) -> None:
    """Make real, on ``device``, the meta tensors that ``holders`` (stage modules of ``model``) hold.

    Each new tensor replaces the meta one everywhere in ``holders`` and ``model`` (ties
    stay one tensor); the rest of ``model`` stays on meta.  Device literals ``meta`` in the
    graphs of ``fx.GraphModule`` holders become ``device``.  Raises
    :class:`~partitioner.errors.ModelFileError` for a tensor nothing can initialise.
    """
    made = _values(model, holders, seed=seed, init_weights=init_weights, device=device, supply=supply)
    if made:
        _replace(made, [model, *holders])


def materialised_values(
    model: nn.Module,
    holders: Sequence[nn.Module],
    *,
    seed: int = 0,
    init_weights: InitWeights | None = None,
    device: torch.device | str = "cpu",
    keep: Callable[[torch.Tensor, bool], torch.Tensor],
) -> dict[str, torch.Tensor]:
    """What :func:`materialise_modules` would give ``holders``' meta tensors, by name in the holders, not put in.

    ``keep(value, is_parameter)`` receives each value as soon as its owner is
    initialised and returns what to keep (a fully sharded rank keeps its shard):
    only one owner's tensors are ever whole at once.  ``holders`` stay on meta.
    """
    made = _values(model, holders, seed=seed, init_weights=init_weights, device=device, supply=None, keep=keep)
    out: dict[str, torch.Tensor] = {}
    for holder in holders:
        for qual, module in holder.named_modules():
            for attr, t in (*module._parameters.items(), *module._buffers.items()):
                if t is not None and id(t) in made:
                    out.setdefault(_state_name(qual, attr), made[id(t)])
    return out


def _values(
    model: nn.Module,
    holders: Sequence[nn.Module],
    *,
    seed: int,
    init_weights: InitWeights | None,
    device: torch.device | str,
    supply: TensorSupply | None,
    keep: Callable[[torch.Tensor, bool], torch.Tensor] | None = None,
) -> dict[int, torch.Tensor]:
    """The value of every meta tensor of ``holders``, by ``id`` of the meta tensor (``keep`` applied)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    for holder in holders:
        if isinstance(holder, fx.GraphModule):
            _rehome(holder, device)
    owners = _owners(model)
    wanted: dict[int, torch.Tensor] = {}
    for holder in holders:
        for t in _tensors(holder):
            if t.is_meta:
                wanted.setdefault(id(t), t)
    if not wanted:
        return {}
    strangers = [_name_in(holders, t) for key, t in wanted.items() if key not in owners]
    if strangers:
        raise ModelFileError(
            f"Tensor {strangers[0]!r} of the stage is on the meta device but is not a parameter or buffer "
            "of the model, so nothing can give it values. Create such constants on a real device "
            "(`torch.tensor(..., device='cpu')`) in the model's code."
        )
    made = _supplied(wanted, owners, supply, device)
    by_owner: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in wanted.items():
        if key not in made:
            owner, attr = owners[key]
            by_owner.setdefault(owner, {})[attr] = tensor
    for owner, needed in by_owner.items():
        values = _initialise(model, owner, needed, seed=seed, init_weights=init_weights, device=device)
        for attr, tensor in needed.items():
            # Popped straight into keep(): the whole value goes as soon as keep() has taken its part.
            made[id(tensor)] = (values.pop(attr) if keep is None
                                else keep(values.pop(attr), isinstance(tensor, nn.Parameter)))
    return made


# ----------------------------------------------------------------- owners


def _tensors(module: nn.Module) -> Iterator[torch.Tensor]:
    """Every parameter and buffer ``module`` holds, once each (ties and shared modules included)."""
    seen: set[int] = set()
    for sub in module.modules():
        for t in (*sub._parameters.values(), *sub._buffers.values()):
            if t is not None and id(t) not in seen:
                seen.add(id(t))
                yield t


def _owners(model: nn.Module) -> dict[int, tuple[str, str]]:
    """``id(tensor)`` -> (owner's qualified name, attribute): the first module holding it directly."""
    found: dict[int, tuple[str, str]] = {}
    for qual, module in model.named_modules():
        for attr, t in (*module._parameters.items(), *module._buffers.items()):
            if t is not None:
                found.setdefault(id(t), (qual, attr))
    return found


def _state_name(owner: str, attr: str) -> str:
    return f"{owner}.{attr}" if owner else attr


def _name_in(holders: Sequence[nn.Module], tensor: torch.Tensor) -> str:
    for holder in holders:
        for qual, module in holder.named_modules():
            for attr, t in (*module._parameters.items(), *module._buffers.items()):
                if t is tensor:
                    return _state_name(qual, attr)
    return "?"


# ----------------------------------------------------------------- supply


def _supplied(
    wanted: Mapping[int, torch.Tensor],
    owners: Mapping[int, tuple[str, str]],
    supply: TensorSupply | None,
    device: torch.device,
) -> dict[int, torch.Tensor]:
    """The tensors ``supply`` gives (a checkpoint), checked and made like the meta ones, by id."""
    if supply is None:
        return {}
    names = {_state_name(*owners[key]): t for key, t in wanted.items()}
    given = supply(names)
    unknown = sorted(set(given) - set(names))
    if unknown:
        raise ModelFileError(f"The weights supplied tensors this rank did not ask for: {unknown[:3]}.")
    made: dict[int, torch.Tensor] = {}
    for name, value in given.items():
        meta = names[name]
        if tuple(value.shape) != tuple(meta.shape):
            raise ModelFileError(
                f"The weights give {name!r} the shape {tuple(value.shape)}, but the model has "
                f"{tuple(meta.shape)}. Load a checkpoint of this model."
            )
        made[id(meta)] = _like(meta, value.detach().to(device=device, dtype=meta.dtype))
    return made


# ----------------------------------------------------------------- initialise


def _initialise(
    model: nn.Module,
    owner: str,
    needed: Mapping[str, torch.Tensor],
    *,
    seed: int,
    init_weights: InitWeights | None,
    device: torch.device,
) -> dict[str, torch.Tensor]:
    """Real values of ``owner``'s tensors ``needed`` (attribute -> meta tensor), by the first step that writes."""
    module = model.get_submodule(owner)
    clone = _clone(module, device)
    own = _own(clone)
    before = {attr: (t, t._version) for attr, t in own.items()}
    fresh = {attr for attr, t in _own(module).items() if t.is_meta}  # the ones holding the marker
    steps: list[tuple[str, Callable[[], Any]]] = []
    if init_weights is not None:
        steps.append(("the model file's init_weights(module, name)", lambda: init_weights(clone, owner)))
    hf_init = _hugging_face_init(model)
    if hf_init is not None:
        steps.append((f"{type(model).__name__}._init_weights(module)", lambda: hf_init(clone)))
    reset = getattr(clone, "reset_parameters", None)
    if callable(reset):
        steps.append((f"{type(module).__name__}.reset_parameters()", reset))
    written: set[str] = set()
    tried: list[str] = []
    for label, step in steps:
        tried.append(label)
        with _seeded(init_seed(seed, owner), device), torch.no_grad(), torch.device(device):
            step()
        now = _own(clone)
        written = {a for a, (t, v) in before.items()
                   if now.get(a) is not t or t._version != v or (a in fresh and _touched(t))}
        if written:
            break
    missing = [attr for attr in needed if attr not in written]
    if missing:
        raise ModelFileError(_uninitialised(module, owner, missing[0], tried, sorted(written),
                                            has_init=init_weights is not None))
    now = _own(clone)
    values: dict[str, torch.Tensor] = {}
    for attr, meta in needed.items():
        value = now[attr]
        if tuple(value.shape) != tuple(meta.shape):
            raise ModelFileError(
                f"Initialising {_state_name(owner, attr)!r} gave it the shape {tuple(value.shape)}, but the "
                f"model built it as {tuple(meta.shape)}. Make init_weights(module, name) keep the shape."
            )
        values[attr] = _like(meta, value.detach().to(device=device, dtype=meta.dtype))
    return values


def _uninitialised(
    module: nn.Module, owner: str, attr: str, tried: list[str], written: list[str], *, has_init: bool
) -> str:
    kind = "parameter" if attr in module._parameters else "buffer"
    where = f"module {owner!r}" if owner else "the model itself"
    if written:
        done = f"{tried[-1]} initialised {', '.join(written)} but not {attr}"
    elif tried:
        done = f"{' and '.join(tried)} left it unwritten"
    else:
        done = f"{type(module).__name__} has no reset_parameters() and the model file no init_weights"
    advice = (
        f"Make the model file's init_weights(module, name) initialise it when name == {owner!r}"
        if has_init else
        "Add `def init_weights(module, name):` to the model file, initialising the module's own "
        f"parameters and buffers in place when it is a {type(module).__name__}"
    )
    return (
        f"The {kind} {_state_name(owner, attr)!r} of {where} ({type(module).__name__}) is on the meta "
        f"device and nothing initialises it: {done}. {advice} (it is called once per module, under a "
        "generator seeded by the module's name), build that tensor on a real device, or load weights "
        "from a checkpoint."
    )


def _hugging_face_init(model: nn.Module) -> Callable[[nn.Module], Any] | None:
    """A Hugging Face ``PreTrainedModel``'s per-module ``_init_weights``, else None."""
    is_hf = any(c.__name__ == "PreTrainedModel" and c.__module__.startswith("transformers.")
                for c in type(model).__mro__)
    init = getattr(model, "_init_weights", None)
    return init if is_hf and callable(init) else None


def _own(module: nn.Module) -> dict[str, torch.Tensor]:
    own: dict[str, torch.Tensor] = {a: t for a, t in module._parameters.items() if t is not None}
    own.update({a: t for a, t in module._buffers.items() if t is not None})
    return own


def _clone(module: nn.Module, device: torch.device) -> nn.Module:
    """A shallow copy of ``module`` with its own meta tensors new on ``device`` and its children on meta.

    The new tensors hold :func:`_unwritten` values; real tensors are copied, so that an
    init writing them leaves the model alone.
    """
    return _shell(module, lambda t: _unwritten(t, device) if t.is_meta else t.detach().clone())


def _unwritten(meta: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A tensor like ``meta`` on ``device`` filled with a marker: NaN, or the integer type's minimum.

    An init that writes through ``.data`` leaves the version counter alone; the
    marker shows the write anyway (and nothing is left uninitialised memory).
    """
    made = torch.empty_like(meta, device=device)
    with torch.no_grad():
        if made.is_floating_point() or made.is_complex():
            made.fill_(float("nan"))
        elif made.dtype != torch.bool:
            made.fill_(torch.iinfo(made.dtype).min)
    return made


def _touched(t: torch.Tensor) -> bool:
    """Does ``t`` hold anything but :func:`_unwritten`'s marker (bool tensors: never known)?"""
    if t.numel() == 0:
        return True
    if t.is_floating_point() or t.is_complex():
        return not bool(torch.isnan(t).all())
    if t.dtype == torch.bool:
        return False
    return not bool((t == torch.iinfo(t.dtype).min).all())


def _shell(module: nn.Module, make: Callable[[torch.Tensor], torch.Tensor]) -> nn.Module:
    """A shallow copy of ``module`` with new tensor dicts holding ``make(t)``, children shells on meta."""
    shell = object.__new__(type(module))  # not copy.copy: some modules pickle themselves to copy
    shell.__dict__.update(module.__dict__)
    shell._parameters = {a: None if t is None else _parameter(t, make(t)) for a, t in module._parameters.items()}
    shell._buffers = {a: None if t is None else make(t) for a, t in module._buffers.items()}
    shell._non_persistent_buffers_set = set(module._non_persistent_buffers_set)
    shell._modules = {k: None if c is None else _shell(c, _on_meta) for k, c in module._modules.items()}
    return shell


def _on_meta(t: torch.Tensor) -> torch.Tensor:
    return t if t.is_meta else torch.empty_like(t, device=_META)


def _parameter(original: nn.Parameter, value: torch.Tensor) -> nn.Parameter:
    made = _like(original, value)
    assert isinstance(made, nn.Parameter)  # _like keeps parameters parameters
    return made


def _like(original: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """``value`` as what ``original`` is: a Parameter with its ``requires_grad``, or a plain tensor."""
    if isinstance(original, nn.Parameter):
        if isinstance(value, nn.Parameter) and value.requires_grad == original.requires_grad:
            return value
        return nn.Parameter(value.detach(), requires_grad=original.requires_grad)
    return value.detach() if isinstance(value, nn.Parameter) else value


@contextlib.contextmanager
def _seeded(seed: int, device: torch.device) -> Iterator[None]:
    """The default generator of ``device`` seeded with ``seed``; every generator restored afterwards."""
    cuda = [device.index] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=cuda):
        torch.default_generator.manual_seed(seed)  # also for CPU draws an init makes on the way
        if device.type == "cuda":
            with torch.cuda.device(device):
                torch.cuda.manual_seed(seed)
        yield


# ----------------------------------------------------------------- swap in


def _replace(made: Mapping[int, torch.Tensor], roots: Iterable[nn.Module]) -> None:
    """Put ``made[id(old)]`` wherever a module of ``roots`` holds ``old``."""
    seen: set[int] = set()
    for root in roots:
        for module in root.modules():
            if id(module) in seen:
                continue
            seen.add(id(module))
            for attr, p in module._parameters.items():
                if p is not None and id(p) in made:
                    module._parameters[attr] = _parameter(p, made[id(p)])
            for attr, b in module._buffers.items():
                if b is not None and id(b) in made:
                    module._buffers[attr] = made[id(b)]


def _rehome(gm: fx.GraphModule, device: torch.device) -> None:
    """Device literals ``meta`` in ``gm``'s graph (export on meta inputs) read as ``device``."""
    home = lambda value: device if value.type == "meta" else value
    changed = False
    for node in gm.graph.nodes:
        found = pytree.tree_leaves((node.args, node.kwargs))
        if any(isinstance(v, torch.device) and v.type == "meta" for v in found):
            node.args, node.kwargs = pytree.tree_map_only(torch.device, home, (node.args, node.kwargs))
            changed = True
    if changed:
        gm.recompile()
