"""Loading model files: the convention, the :NAME form, and every error's advice."""

from __future__ import annotations

import os
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

from partitioner.errors import ModelFileError
from partitioner.modelfile import ModelFile, load_model_file, split_spec

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"

GOOD = """
import torch
from torch import nn

def build_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))

def other():
    return nn.Linear(4, 3)

def not_a_model():
    return "hello"

def example_inputs(batch_size):
    return (torch.randn(batch_size, 4),)

def example_target(batch_size):
    return torch.zeros(batch_size, dtype=torch.long)

def loss_fn(outputs, target):
    return nn.functional.cross_entropy(outputs, target)
"""


def _write(tmp_path: Path, text: str, name: str = "model.py") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def _error(spec: str | Path) -> str:
    with pytest.raises(ModelFileError) as info:
        mf = load_model_file(str(spec))
        mf.example_inputs(4)
        mf.build()
    return str(info.value)


def test_loads_the_convention(tmp_path: Path) -> None:
    mf = load_model_file(str(_write(tmp_path, GOOD)))
    assert isinstance(mf, ModelFile)
    assert mf.path == (tmp_path / "model.py").resolve()
    model = mf.build()
    assert isinstance(model, nn.Sequential)
    (x,) = mf.example_inputs(6)
    assert x.shape == (6, 4)
    assert mf.default_batch_size is None
    assert mf.loss_fn is not None and mf.example_target is not None
    loss = mf.loss_fn(model(x), mf.example_target(6))
    assert loss.dim() == 0


def test_factory_name(tmp_path: Path) -> None:
    path = _write(tmp_path, GOOD)
    model = load_model_file(f"{path}:other").build()
    assert isinstance(model, nn.Linear) and model.out_features == 3


def test_split_spec() -> None:
    assert split_spec("a/b.py:make") == ("a/b.py", "make")
    assert split_spec("a/b.py") == ("a/b.py", None)
    assert split_spec("C:/x/b.py") == ("C:/x/b.py", None)


def test_module_level_model_and_tuple_inputs(tmp_path: Path) -> None:
    path = _write(tmp_path, """
        import torch
        model = torch.nn.Linear(4, 2)
        example_inputs = (torch.randn(5, 4),)
    """)
    mf = load_model_file(str(path))
    assert mf.default_batch_size == 5
    assert mf.build() is mf.build()
    assert mf.example_inputs(5)[0].shape == (5, 4)
    assert mf.loss_fn is None and mf.example_target is None
    with pytest.raises(ModelFileError, match=r"--batch-size 5.*def example_inputs\(batch_size\)"):
        mf.example_inputs(8)


def test_single_tensor_is_wrapped(tmp_path: Path) -> None:
    path = _write(tmp_path, """
        import torch
        model = torch.nn.Linear(4, 2)
        def example_inputs(batch_size):
            return torch.randn(batch_size, 4)
    """)
    (x,) = load_model_file(str(path)).example_inputs(3)
    assert x.shape == (3, 4)


def test_dataclass_in_model_file(tmp_path: Path) -> None:
    path = _write(tmp_path, """
        import dataclasses
        import torch

        @dataclasses.dataclass(frozen=True)
        class Config:
            width: int = 4

        def build_model(config: Config | None = None):
            return torch.nn.Linear((config or Config()).width, 2)

        def example_inputs(batch_size):
            return (torch.randn(batch_size, Config().width),)
    """)
    assert load_model_file(str(path)).build().in_features == 4


def test_sibling_import(tmp_path: Path) -> None:
    _write(tmp_path, "import torch\ndef make():\n    return torch.nn.Linear(4, 2)\n", name="helpers_ap.py")
    path = _write(tmp_path, """
        import torch
        from helpers_ap import make
        def build_model():
            return make()
        def example_inputs(batch_size):
            return (torch.randn(batch_size, 4),)
    """)
    assert isinstance(load_model_file(str(path)).build(), nn.Linear)
    assert str(tmp_path) not in sys.path
    sys.modules.pop("helpers_ap", None)


def test_examples_gpt() -> None:
    mf = load_model_file(f"{EXAMPLES / 'gpt.py'}:gpt_small")
    (idx,) = mf.example_inputs(2)
    assert idx.shape == (2, 32) and idx.dtype == torch.long
    assert mf.loss_fn is not None and mf.example_target is not None


# ----------------------------------------------------------------- errors


def test_missing_file(tmp_path: Path) -> None:
    message = _error(tmp_path / "nope.py")
    assert "does not exist" in message and "nope.py" in message and os.getcwd() in message


def test_not_python(tmp_path: Path) -> None:
    path = tmp_path / "model.txt"
    path.write_text("x = 1\n")
    assert "is not a Python file" in _error(path)
    assert "not a Python file" in _error(tmp_path)  # a directory


def test_import_fails_names_the_line(tmp_path: Path) -> None:
    path = _write(tmp_path, """
        import torch

        x = 1
        y = 1 / 0
    """)
    message = _error(path)
    assert "ZeroDivisionError" in message and "line 5" in message and "y = 1 / 0" in message
    assert "Fix the model file" in message
    assert not [m for m in sys.modules if m.startswith("_autopartition_model_model_") and
                getattr(sys.modules[m], "__file__", "") == str(path)]


def test_syntax_error(tmp_path: Path) -> None:
    path = _write(tmp_path, "def build_model(:\n    pass\n")
    message = _error(path)
    assert "SyntaxError" in message and "line 1" in message


def test_missing_package(tmp_path: Path) -> None:
    path = _write(tmp_path, "import surely_not_installed_pkg\n")
    message = _error(path)
    assert "ModuleNotFoundError" in message and "pip install surely_not_installed_pkg" in message


def test_no_factory(tmp_path: Path) -> None:
    path = _write(tmp_path, """
        import torch
        def make_net():
            return torch.nn.Linear(4, 2)
        def example_inputs(batch_size):
            return (torch.randn(batch_size, 4),)
    """)
    message = _error(path)
    assert "neither build_model() nor a module-level `model`" in message
    assert "make_net" in message and "def build_model()" in message


def test_unknown_factory_lists_callables(tmp_path: Path) -> None:
    message = _error(f"{_write(tmp_path, GOOD)}:missing")
    assert "no factory named 'missing'" in message
    assert "build_model, example_inputs, example_target, loss_fn, not_a_model, other" in message


def test_factory_returns_non_module(tmp_path: Path) -> None:
    message = _error(f"{_write(tmp_path, GOOD)}:not_a_model")
    assert "returned a str, not an nn.Module" in message and "Return the model instance" in message


def test_factory_raises(tmp_path: Path) -> None:
    path = _write(tmp_path, """
        import torch
        def build_model():
            raise RuntimeError("boom")
        def example_inputs(batch_size):
            return (torch.randn(batch_size, 4),)
    """)
    message = _error(path)
    assert "build_model() raised RuntimeError: boom" in message and "line 4" in message


def test_no_example_inputs(tmp_path: Path) -> None:
    path = _write(tmp_path, "import torch\nmodel = torch.nn.Linear(4, 2)\n")
    message = _error(path)
    assert "has no example_inputs" in message and "def example_inputs(batch_size)" in message


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ("return [1, 2]", "hold no tensor"),
        ("return (torch.randn(batch_size, 4), object())", "args[1] is a object"),
        ("return 3", "gave a int; it must be a tuple"),
        ("return ()", "gave an empty tuple"),
        ("return (torch.randn(2, 4),)", "dimension 0 is not the batch size 4"),
    ],
)
def test_bad_example_inputs(tmp_path: Path, body: str, expected: str) -> None:
    path = _write(tmp_path, f"""
        import torch
        model = torch.nn.Linear(4, 2)
        def example_inputs(batch_size):
            {body}
    """)
    assert expected in _error(path)


def test_example_inputs_without_batch_size(tmp_path: Path) -> None:
    path = _write(tmp_path, """
        import torch
        model = torch.nn.Linear(4, 2)
        def example_inputs():
            return (torch.randn(4, 4),)
    """)
    assert "must take the batch size" in _error(path)


def test_bad_module_level_values(tmp_path: Path) -> None:
    path = _write(tmp_path, "import torch\nmodel = 3\nexample_inputs = (torch.randn(2, 4),)\n")
    assert "defines `model` as a int, not an nn.Module" in _error(path)
    path = _write(tmp_path, "import torch\nmodel = torch.nn.Linear(4, 2)\nexample_inputs = (torch.randn(2, 4), {1})\n")
    assert "args[1] is a set" in _error(path)
