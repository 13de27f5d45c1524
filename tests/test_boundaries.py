"""Architecture rules (docs/architecture.md), checked on the source and in fresh interpreters.

* The solver modules are numbers in, numbers out: they import where torch is missing.
* Dependencies point one way: no partitioner module but the CLI imports ``runtime``.
* The runtime reads plans; it never imports the planner's solving passes.
* ``import partitioner`` and ``autopartition --help`` do not import torch.

Imports are read with :mod:`ast` (``import``, ``from ... import`` and
``importlib.import_module("...")`` / ``__import__("...")`` strings, at any depth,
so imports inside functions count too) and, where the rule is about what a
module pulls in transitively, checked in a subprocess.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# Modules that must import without torch. The first three are the solver; the rest are
# pure helpers some versions have (listed here so they are held to the rule when present).
TORCH_FREE = (
    "partitioner.problem",
    "partitioner.interval",
    "partitioner.solve",
    "partitioner.units",
    "partitioner.commcost",
    "partitioner.defaults",
    "partitioner.errors",
    "partitioner.precision",
    "partitioner.devices",
)
_REQUIRED = {"partitioner.problem", "partitioner.interval", "partitioner.solve"}

# The partitioner modules allowed to import the runtime, inside functions only (importing the
# partitioner loads none of it): the CLI launches it; splitcost times its split backward.
RUNTIME_IMPORTERS = {"partitioner.cli", "partitioner.splitcost"}

# What the runtime must not import: the passes that solve, and the names that lead to them.
SOLVING_PASSES = (
    "partitioner.planner",
    "partitioner.search",
    "partitioner.scaledcosts",
    "partitioner.assemble",
    "partitioner.solve",
    "partitioner.interval",
    "partitioner.formulate",
    "partitioner.coarsen",
    "partitioner.cost",
    "partitioner.compile",  # `from partitioner import compile` loads the planner
)

# A meta-path finder that makes torch unavailable, as on a machine without it.
_NO_TORCH = """
import sys

class _NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError(f"torch is not available here (importing {name})")
        return None

sys.meta_path.insert(0, _NoTorch())
"""


def _module_name(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts)


def _sources(package: str) -> list[Path]:
    return sorted((ROOT / package).glob("*.py"))


def _existing(modules: tuple[str, ...]) -> list[str]:
    return [m for m in modules if (ROOT / (m.replace(".", "/") + ".py")).exists()]


def _imports(path: Path) -> set[str]:
    """Every module name ``path`` imports; ``from a import b`` gives both ``a`` and ``a.b``."""
    package = _module_name(path).split(".")[:-1]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against this module's package
                parent = ".".join(package[: len(package) - node.level + 1])
                base = f"{parent}.{base}" if base else parent
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Call) and node.args and _is_dynamic_import(node.func):
            first = node.args[0]
            if isinstance(first, ast.Constant) and isinstance(first.value, str):
                found.add(first.value)
    return found


def _is_dynamic_import(func: ast.expr) -> bool:
    name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
    return name in ("import_module", "__import__")


def _within(name: str, modules: tuple[str, ...] | set[str] | str) -> bool:
    roots = (modules,) if isinstance(modules, str) else tuple(modules)
    return any(name == root or name.startswith(root + ".") for root in roots)


def _python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, check=False)


def _loaded_after(code: str, *, no_torch: bool = False) -> list[str]:
    """Run ``code`` in a fresh interpreter; the names in sys.modules afterwards."""
    script = (_NO_TORCH if no_torch else "") + textwrap.dedent(code) + (
        "\nimport json\nprint(json.dumps(sorted(sys.modules)))\n"
    )
    done = _python("import sys\n" + script)
    assert done.returncode == 0, done.stderr
    return list(json.loads(done.stdout.strip().splitlines()[-1]))


# ----------------------------------------------------------------- the solver needs no torch


def test_solver_modules_import_without_torch() -> None:
    modules = _existing(TORCH_FREE)
    assert _REQUIRED <= set(modules)
    loaded = _loaded_after("\n".join(f"import {m}" for m in modules), no_torch=True)
    assert "torch" not in loaded


def test_the_torch_blocker_works() -> None:
    done = _python(_NO_TORCH + "import partitioner.capture\n")
    assert done.returncode != 0 and "torch is not available here" in done.stderr


# ----------------------------------------------------------------- dependencies point one way


def test_only_the_cli_imports_the_runtime() -> None:
    offenders = {
        _module_name(path): sorted(n for n in _imports(path) if _within(n, "runtime"))
        for path in _sources("partitioner")
        if _module_name(path) not in RUNTIME_IMPORTERS
    }
    assert {m: names for m, names in offenders.items() if names} == {}


def test_partitioner_does_not_load_the_runtime() -> None:
    modules = [_module_name(p) for p in _sources("partitioner")]
    modules = [m for m in modules if m not in RUNTIME_IMPORTERS and not m.endswith("__main__")]
    loaded = _loaded_after("\n".join(f"import {m}" for m in modules))
    assert [m for m in loaded if _within(m, "runtime")] == []


def test_runtime_never_imports_the_solving_passes() -> None:
    offenders = {
        _module_name(path): sorted(n for n in _imports(path) if _within(n, SOLVING_PASSES))
        for path in _sources("runtime")
    }
    assert {m: names for m, names in offenders.items() if names} == {}


def test_runtime_does_not_load_the_solving_passes() -> None:
    modules = [_module_name(p) for p in _sources("runtime")]
    loaded = _loaded_after("\n".join(f"import {m}" for m in modules))
    assert [m for m in loaded if _within(m, SOLVING_PASSES)] == []


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("import runtime.verify", {"runtime.verify"}),
        ("from runtime import launch", {"runtime", "runtime.launch"}),
        ("def f():\n    importlib.import_module('runtime.verify')", {"runtime.verify"}),
        ("from partitioner import compile", {"partitioner", "partitioner.compile"}),
        ("from . import planner", {"partitioner", "partitioner.planner"}),
        ("from .solve import solve", {"partitioner.solve", "partitioner.solve.solve"}),
    ],
)
def test_import_reader(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, source: str,
                       expected: set[str]) -> None:
    """The checks above see every way of importing (otherwise they would pass vacuously)."""
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    path = tmp_path / "partitioner" / "example.py"
    path.parent.mkdir()
    path.write_text(source + "\n")
    assert _imports(path) == expected


# ----------------------------------------------------------------- cheap entry points


def test_import_partitioner_does_not_import_torch() -> None:
    loaded = _loaded_after("import partitioner\nfrom partitioner import AutopartitionError, load_plan")
    assert "torch" not in loaded
    assert "partitioner.planner" not in loaded


def test_help_does_not_import_torch() -> None:
    loaded = _loaded_after(
        """
        import contextlib, io
        from partitioner.cli import main
        for argv in (["--help"], ["show", "--help"], ["verify", "--help"], ["run", "--help"]):
            with contextlib.redirect_stdout(io.StringIO()):
                assert main(argv) == 0, argv
        """,
        no_torch=True,
    )
    assert "torch" not in loaded


def test_compile_is_still_reachable_from_the_package() -> None:
    import partitioner
    from partitioner import planner

    assert partitioner.compile is planner.compile
    assert "compile" in dir(partitioner)
    with pytest.raises(AttributeError, match="no attribute 'nonexistent'"):
        partitioner.nonexistent  # noqa: B018
