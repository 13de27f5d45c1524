"""Load a user's model file: ``path/to/model.py`` or ``path/to/model.py:FACTORY``.

The file is imported by path and must define (see DESIGN.md):

* ``build_model()`` returning an ``nn.Module``, or a module-level ``model``;
  ``model.py:NAME`` picks the factory ``NAME`` instead;
* ``example_inputs(batch_size)`` returning one mini-batch's inputs (batch in
  dimension 0 of every tensor): a tuple of positional arguments, a dict of keyword
  arguments, or ``(args, kwargs)``; ``None``, bools, numbers and strings are baked
  into the graph.  Or a module-level value ``example_inputs``;
* optionally ``loss_fn(outputs, target)`` and ``example_target(batch_size)``;
* optionally ``init_weights(module, name)``, which initialises one submodule of
  a model built on the meta device (:mod:`runtime.state.materialise`);
* or, for a model that computes its own loss (Hugging Face ``labels=``),
  ``example_target(batch_size)`` and ``target_keyword = "labels"``, the keyword
  the target is passed as (no ``loss_fn``).

Everything that can go wrong raises :class:`~partitioner.errors.ModelFileError`
with a message that says what is wrong and how to fix it.

Example::

    >>> mf = load_model_file("examples/gpt.py")  # doctest: +SKIP
    >>> model, inputs = mf.build(), mf.example_inputs(4)  # doctest: +SKIP
    >>> inputs[0].shape  # doctest: +SKIP
    torch.Size([4, 32])
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import inspect
import itertools
import os
import sys
import traceback
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from partitioner.errors import CaptureError, ModelFileError
from partitioner.graph.capture import CallSpec, split_call

__all__ = ["ModelFile", "forward_failure", "load_model_file", "split_spec"]

_counter = itertools.count()


@dataclasses.dataclass(frozen=True)
class ModelFile:
    """What a model file provides, as checked callables.

    ``build()`` returns the model (checked to be an ``nn.Module``);
    ``example_inputs(batch_size)`` returns the inputs as the file gives them: a
    tuple (a single tensor is wrapped), a dict of keywords, or ``(args, kwargs)``;
    with ``target_keyword`` the target is already among them, as that keyword
    (the model computes its own loss).  ``default_batch_size`` is set when the
    file fixes the inputs at module level (then no other batch size is possible).
    """

    path: Path
    build: Callable[[], nn.Module]
    example_inputs: Callable[[int], Any]
    loss_fn: Callable[..., Any] | None
    example_target: Callable[[int], Any] | None
    default_batch_size: int | None
    target_keyword: str | None = None
    # ``init_weights(module, name)``: initialises one submodule of a model built on the meta device.
    init_weights: Callable[[nn.Module, str], Any] | None = None


def split_spec(spec: str) -> tuple[str, str | None]:
    """``"dir/model.py:NAME"`` -> ``("dir/model.py", "NAME")``; no ``:NAME`` -> ``(spec, None)``.

    >>> split_spec("examples/gpt.py:gpt_medium")
    ('examples/gpt.py', 'gpt_medium')
    >>> split_spec("C:/models/net.py")
    ('C:/models/net.py', None)
    """
    path, sep, name = spec.rpartition(":")
    if sep and name.isidentifier() and path.endswith(".py"):
        return path, name
    return spec, None


def load_model_file(spec: str) -> ModelFile:
    """Import the model file named by ``spec`` and check that it follows the convention."""
    path_text, factory = split_spec(spec)
    path = Path(path_text).expanduser()
    if not path.exists():
        raise ModelFileError(
            f"Model file {path_text!r} does not exist (looked for {path.absolute()}, "
            f"the current directory being {os.getcwd()}). Check the path, or run from the "
            "directory the path is relative to."
        )
    if path.is_dir() or path.suffix != ".py":
        raise ModelFileError(
            f"{path_text!r} is not a Python file. Pass the model file itself, e.g. "
            "`autopartition path/to/model.py --gpus 8`, where model.py defines build_model() "
            "and example_inputs(batch_size)."
        )
    path = path.resolve()
    module = _import(path)
    build = _factory(module, path, factory)
    inputs, default_batch = _example_inputs(module, path)
    loss_fn = getattr(module, "loss_fn", None)
    if loss_fn is not None and not callable(loss_fn):
        raise ModelFileError(
            f"{path.name} defines loss_fn as a {type(loss_fn).__name__}, not a function. "
            "Define `def loss_fn(outputs, target):` returning a scalar mean loss, or remove the name."
        )
    init = getattr(module, "init_weights", None)
    if init is not None and not callable(init):
        raise ModelFileError(
            f"{path.name} defines init_weights as a {type(init).__name__}, not a function. Define "
            "`def init_weights(module, name):` to initialise one submodule of a model built on meta."
        )
    target = _example_target(module, path)
    keyword = getattr(module, "target_keyword", None)
    if keyword is not None:
        if not isinstance(keyword, str) or not keyword.isidentifier():
            raise ModelFileError(
                f"{path.name} sets target_keyword to {keyword!r}; it must name the model's keyword "
                "argument that takes the target, e.g. `target_keyword = \"labels\"`."
            )
        if target is None or loss_fn is not None:
            raise ModelFileError(
                f"{path.name} sets target_keyword, so the model computes its own loss from the target: "
                "define example_target(batch_size) and no loss_fn (or drop target_keyword)."
            )
        inputs = _with_target(inputs, target, keyword)
    return ModelFile(
        path=path,
        build=build,
        example_inputs=inputs,
        loss_fn=_wrap_call(loss_fn, path, "loss_fn") if loss_fn is not None else None,
        example_target=target,
        default_batch_size=default_batch,
        target_keyword=keyword,
        init_weights=_wrap_call(init, path, "init_weights") if init is not None else None,
    )


# ----------------------------------------------------------------- import


@contextlib.contextmanager
def _on_path(directory: Path) -> Iterator[None]:
    """Put the model file's directory on ``sys.path`` (as ``python model.py`` would), then undo."""
    entry = str(directory)
    added = entry not in sys.path
    if added:
        sys.path.insert(0, entry)
    try:
        yield
    finally:
        if added and entry in sys.path:
            sys.path.remove(entry)


def _import(path: Path) -> types.ModuleType:
    name = f"_autopartition_model_{_identifier(path.stem)}_{next(_counter)}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ModelFileError(f"Python cannot import {path} as a module; rename it to a plain `name.py`.")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # before exec_module: dataclasses and pickling look the module up
    try:
        with _on_path(path.parent):
            spec.loader.exec_module(module)
    except Exception as exc:  # any failure in user code becomes advice
        sys.modules.pop(name, None)
        advice = f"Fix the model file so that `python {path.name}` runs without errors."
        if isinstance(exc, ModuleNotFoundError) and exc.name:
            advice = (
                f"Install the missing package (`pip install {exc.name.split('.')[0]}`) in this "
                f"environment ({sys.executable}), or fix the import."
            )
        raise ModelFileError(
            f"Importing {path} failed with {_describe(exc, path)}. {advice}"
        ) from exc
    return module


def _identifier(text: str) -> str:
    return "".join(c if c.isalnum() or c == "_" else "_" for c in text)


def _describe(exc: BaseException, path: Path) -> str:
    """``TypeName: message (model.py, line N: `code`)``, naming the model file's line when possible."""
    text = f"{type(exc).__name__}: {exc}"
    if isinstance(exc, SyntaxError) and exc.filename and Path(exc.filename).resolve() == path:
        line = (exc.text or "").strip()
        return f"{type(exc).__name__}: {exc.msg} ({path.name}, line {exc.lineno}" + (
            f": `{line}`)" if line else ")"
        )
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if _same_file(f.filename, path)]
    if frames:
        frame = frames[-1]
        code = (frame.line or "").strip()
        text += f" ({path.name}, line {frame.lineno}" + (f": `{code}`)" if code else ")")
    return text


def forward_failure(model: nn.Module, inputs: tuple[torch.Tensor, ...], *, call: CallSpec) -> CaptureError | None:
    """What ``model`` raises run eagerly on ``inputs`` (the flat tensors ``call`` places), as an error; None if it runs.

    A capture or shape-propagation failure is often no capture limitation but the model
    rejecting its own example inputs (a sequence longer than its position embedding): every
    capture method fails the same way, so the capture advice would mislead.  Called only
    once capturing has failed; the model's buffers (running statistics) are put back after.
    A model built on ``meta`` (or given meta inputs) is not run: meta tensors hold no
    values, so whatever reads one (``.item()``, a branch on a tensor, an op without a meta
    kernel) fails there however good the inputs are; the capture error says more.
    """
    args, kwargs = call.rebuild(inputs)
    tensors = [*model.parameters(), *model.buffers(), *pytree.tree_leaves((args, kwargs))]
    if any(isinstance(t, torch.Tensor) and t.is_meta for t in tensors):
        return None
    buffers = {name: b.detach().clone() for name, b in model.named_buffers()}
    try:
        with torch.no_grad():
            model(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - whatever the model raises is the diagnosis
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        where = _model_frame(exc)
        shapes = ", ".join(f"{name} {tuple(x.shape)} {str(x.dtype).removeprefix('torch.')}"
                           for name, x in zip(call.names, inputs))
        return CaptureError(
            f"{type(model).__name__}'s forward raised {type(exc).__name__}: {first}"
            f"{f' at {where}' if where else ''}, run as it is on one micro-batch of the example inputs ({shapes}). "
            "The model fails on its own example inputs, so this is not a capture limitation and no --capture "
            "method helps: make example_inputs fit the model (an index out of range is often a sequence longer "
            "than the model's block_size or maximum positions), or fix forward()."
        )
    finally:
        with torch.no_grad():
            for name, value in buffers.items():
                model.get_buffer(name).copy_(value)
    return None


def _model_frame(exc: BaseException) -> str | None:
    """``file:line in function(): `code` `` of the innermost frame in the user's code (not torch's, ours or Python's)."""
    skipped = tuple(str(Path(m.__file__).resolve().parent) for m in (torch, os) if m.__file__)
    ours = str(Path(__file__).resolve().parent)
    found = None
    for frame in traceback.extract_tb(exc.__traceback__):
        name = str(Path(frame.filename).resolve()) if not frame.filename.startswith("<") else ""
        if not name or name.startswith((*skipped, ours)):
            continue
        code = (frame.line or "").strip()
        found = f"{frame.filename}:{frame.lineno} in {frame.name}()" + (f": `{code}`" if code else "")
    return found


def _same_file(filename: str, path: Path) -> bool:
    try:
        return Path(filename).resolve() == path
    except (OSError, ValueError):
        return False


# ----------------------------------------------------------------- names


def _factory(module: types.ModuleType, path: Path, name: str | None) -> Callable[[], nn.Module]:
    if name is not None:
        if not hasattr(module, name):
            raise ModelFileError(
                f"{path.name} has no factory named {name!r}. Callables defined there: "
                f"{_callables(module)}. Use `{path.name}:ONE_OF_THESE`, or drop `:{name}` to use "
                "build_model()."
            )
        value = getattr(module, name)
        if isinstance(value, nn.Module):
            return _fixed_model(value)
        if not callable(value):
            raise ModelFileError(
                f"{path.name}:{name} is a {type(value).__name__}, not a function. Name a function "
                "that takes no arguments and returns the nn.Module."
            )
        return _checked_factory(value, path, name)
    if hasattr(module, "build_model"):
        value = module.build_model
        if not callable(value):
            raise ModelFileError(
                f"{path.name} defines build_model as a {type(value).__name__}, not a function. "
                "Define `def build_model():` returning the nn.Module."
            )
        return _checked_factory(value, path, "build_model")
    if hasattr(module, "model"):
        value = module.model
        if not isinstance(value, nn.Module):
            raise ModelFileError(
                f"{path.name} defines `model` as a {type(value).__name__}, not an nn.Module. Bind "
                "`model` to the module instance, or define `def build_model():` returning it."
            )
        return _fixed_model(value)
    raise ModelFileError(
        f"{path.name} defines neither build_model() nor a module-level `model`. Add "
        "`def build_model(): return MyModel()`, or pick another factory with "
        f"`{path.name}:NAME` (callables there: {_callables(module)})."
    )


def _callables(module: types.ModuleType) -> str:
    names = [
        n
        for n, v in vars(module).items()
        if not n.startswith("_")
        and (inspect.isfunction(v) or inspect.isclass(v))
        and getattr(v, "__module__", None) == module.__name__
    ]
    return ", ".join(sorted(names)) or "none"


def _fixed_model(model: nn.Module) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        return model

    return build


def _checked_factory(factory: Callable[..., Any], path: Path, name: str) -> Callable[[], nn.Module]:
    call = _wrap_call(factory, path, name)

    def build() -> nn.Module:
        model = call()
        if not isinstance(model, nn.Module):
            raise ModelFileError(
                f"{path.name}:{name}() returned a {type(model).__name__}, not an nn.Module. "
                "Return the model instance itself (not a class, a state dict or a tuple)."
            )
        return model

    return build


def _wrap_call(function: Callable[..., Any], path: Path, name: str) -> Callable[..., Any]:
    """Call ``function`` with the model file's directory on sys.path; its errors become ModelFileError."""

    def call(*args: Any) -> Any:
        try:
            with _on_path(path.parent):
                return function(*args)
        except ModelFileError:
            raise
        except Exception as exc:  # a failure in user code becomes advice
            shown = ", ".join(map(repr, args)) if all(isinstance(a, int) for a in args) else "..."
            raise ModelFileError(
                f"{path.name}:{name}({shown}) raised {_describe(exc, path)}. Fix {name} in the model file."
            ) from exc

    return call


# ----------------------------------------------------------------- inputs


def _example_inputs(
    module: types.ModuleType, path: Path
) -> tuple[Callable[[int], Any], int | None]:
    if not hasattr(module, "example_inputs"):
        raise ModelFileError(
            f"{path.name} has no example_inputs. Add `def example_inputs(batch_size): return "
            "(torch.randn(batch_size, ...),)` returning the inputs of one mini-batch (batch in "
            "dimension 0): a tuple of positional arguments, a dict of keyword arguments, or "
            "(args, kwargs); or bind such a value to a module-level `example_inputs`."
        )
    value = module.example_inputs
    if isinstance(value, (tuple, list, dict, torch.Tensor)):
        fixed = _checked_inputs(value, path, "example_inputs")
        batch = _fixed_batch(_tensors(fixed), path, "example_inputs")

        def fixed_inputs(batch_size: int) -> Any:
            if batch_size != batch:
                raise ModelFileError(
                    f"{path.name} fixes example_inputs with batch size {batch}, so "
                    f"batch size {batch_size} is not possible. Use --batch-size {batch}, or define "
                    "`def example_inputs(batch_size):` to allow any batch size."
                )
            return fixed

        return fixed_inputs, batch
    if not callable(value):
        raise ModelFileError(
            f"{path.name} defines example_inputs as a {type(value).__name__}. Define "
            "`def example_inputs(batch_size):` returning a tuple of tensors (or a dict of keyword "
            "arguments), or bind such a value."
        )
    _check_takes_batch_size(value, path, "example_inputs")
    call = _wrap_call(value, path, "example_inputs")

    def inputs(batch_size: int) -> Any:
        given = _checked_inputs(call(batch_size), path, f"example_inputs({batch_size})")
        tensors = _tensors(given)
        wrong = [(n, t) for n, t in tensors.items() if t.dim() > 0 and t.shape[0] != batch_size]
        if wrong:
            shapes = ", ".join(f"{n}: {tuple(t.shape)}" for n, t in wrong)
            raise ModelFileError(
                f"{path.name}:example_inputs({batch_size}) returned tensors whose dimension 0 is "
                f"not the batch size {batch_size} ({shapes}). Put the batch in dimension 0 of every input."
            )
        return given

    return inputs, None


def _with_target(
    inputs: Callable[[int], Any], target: Callable[[int], Any], keyword: str
) -> Callable[[int], Any]:
    """``example_inputs`` with the target added as the model's keyword ``keyword`` (HF ``labels``)."""

    def merged(batch_size: int) -> Any:
        args, kwargs = split_call(inputs(batch_size))
        return (args, {**kwargs, keyword: target(batch_size)})

    return merged


def _example_target(module: types.ModuleType, path: Path) -> Callable[[int], Any] | None:
    if not hasattr(module, "example_target"):
        return None
    value = module.example_target
    if isinstance(value, torch.Tensor):
        batch = value.shape[0] if value.dim() > 0 else None

        def fixed_target(batch_size: int) -> Any:
            if batch is not None and batch_size != batch:
                raise ModelFileError(
                    f"{path.name} fixes example_target with batch size {batch}; batch size "
                    f"{batch_size} is not possible. Use --batch-size {batch}, or define "
                    "`def example_target(batch_size):`."
                )
            return value

        return fixed_target
    if not callable(value):
        raise ModelFileError(
            f"{path.name} defines example_target as a {type(value).__name__}. Define "
            "`def example_target(batch_size):` returning the target of one mini-batch."
        )
    _check_takes_batch_size(value, path, "example_target")
    return _wrap_call(value, path, "example_target")


def _check_takes_batch_size(function: Callable[..., Any], path: Path, name: str) -> None:
    try:
        inspect.signature(function).bind(1)
    except TypeError:
        raise ModelFileError(
            f"{path.name}:{name} must take the batch size as its one argument "
            f"(`def {name}(batch_size):`); its signature is {name}{inspect.signature(function)}."
        ) from None
    except ValueError:  # no signature (builtins): let the call tell
        pass


def _checked_inputs(value: Any, path: Path, what: str) -> Any:
    """``value`` if it is a valid input structure (a single tensor becomes a 1-tuple)."""
    if isinstance(value, torch.Tensor):
        return (value,)
    if not isinstance(value, (tuple, list, dict)):
        raise ModelFileError(
            f"{path.name}:{what} gave a {type(value).__name__}; it must be a tuple of the model's "
            "positional inputs, a dict of its keyword inputs, or (args, kwargs). Return `(x,)` for one input."
        )
    if not value:
        raise ModelFileError(
            f"{path.name}:{what} gave an empty {type(value).__name__}; return the model's "
            "input tensors, e.g. `(torch.randn(batch_size, 16),)`."
        )
    try:
        CallSpec.of(value)
    except CaptureError as exc:
        raise ModelFileError(f"{path.name}:{what}: {exc}") from None
    return tuple(value) if isinstance(value, list) else value


def _tensors(value: Any) -> dict[str, torch.Tensor]:
    """Every input tensor by its place (``args[0]``, ``attention_mask``)."""
    spec, flat = CallSpec.of(value)
    return dict(zip(spec.names, flat))


def _fixed_batch(tensors: dict[str, torch.Tensor], path: Path, what: str) -> int:
    sizes = sorted({t.shape[0] for t in tensors.values() if t.dim() > 0})
    if len(sizes) != 1:
        raise ModelFileError(
            f"{path.name}:{what} needs one batch size in dimension 0 of its tensors; found "
            f"{sizes or 'only scalars'}. Put the batch in dimension 0 of every input."
        )
    return int(sizes[0])
