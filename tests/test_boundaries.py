"""Architecture rules (docs/architecture.md), checked on the source and in fresh interpreters.

* The passes are layers: ``base`` (errors, units, defaults, orders, layout) < ``graph/`` (and
  modelfile) < ``cost/`` < ``solve/`` < ``plan`` (plan, stagegraph, agree) <
  ``schedule/`` < ``report/`` < ``search/`` < ``cli``.  No module imports one of a
  higher layer, and no two subpackages (or flat modules) import each other, even
  through others.
* ``solve/``, ``schedule/``, ``plan``, ``orders``, ``units``, ``errors``, ``defaults``
  and cost's numbers-only modules import where torch is missing.
* No partitioner module imports the runtime, except ``cli``, which reaches it only
  through ``runtime/commands.py``, inside the verify and run commands; the split
  backward the cost model times lives in ``partitioner/graph``.  The runtime imports
  no solving pass.
* ``import partitioner`` and ``autopartition --help`` do not import torch.
* The runtime's subpackages are floors: ``execute`` (the stage, its wire, its runner)
  < ``state`` (values, weights, checkpoints, precision) < ``parallel`` (tensor split,
  sharding, replication) < ``engines`` < ``launch`` < the flat top (``pipeline``,
  ``evaluate``, ``verify``, ``commands``).  No runtime module imports one of a higher
  floor, no two floors import each other, and no two runtime modules do either
  (function-level imports count).  ``launch``, ``engines.choice``, ``state.folders``,
  ``execute.wire``, ``commands`` and every subpackage's ``__init__`` import without torch.

Imports are read with :mod:`ast` (``import``, ``from ... import``, relative imports
and ``importlib.import_module("...")`` / ``__import__("...")`` strings, at any depth,
so imports inside functions and ``TYPE_CHECKING`` blocks count too) and, where the
rule is about what a module pulls in transitively, checked in a subprocess.  Each
checker is also run on a small tree that breaks its rule, so none passes vacuously.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import networkx as nx
import pytest

ROOT = Path(__file__).resolve().parent.parent

# Every unit of the partitioner (a subpackage, or a flat module) and its layer: a module may import
# its own layer and the ones below it.  A new file must be placed here (test_every_unit_has_a_layer).
LAYERS: dict[str, int] = {
    "errors": 0, "units": 0, "defaults": 0, "orders": 0, "layout": 0,
    "graph": 1, "modelfile": 1,
    "cost": 2,
    "solve": 3,
    "plan": 4, "stagegraph": 4, "agree": 4,
    "schedule": 5,
    "report": 6, "export": 6,
    "search": 7,
    "cli": 8, "__main__": 8, "__init__": 8,
}

# Every unit of the runtime (a subpackage, or a flat module) and its floor, as LAYERS for the planner.
RUNTIME_FLOORS: dict[str, int] = {
    "execute": 0,
    "state": 1,
    "parallel": 2,
    "engines": 3,
    "launch": 4,
    "evaluate": 5, "pipeline": 5, "verify": 5, "commands": 5, "__init__": 5,
}

# Runtime modules that must import without torch: what `autopartition run` imports before torchrun
# starts, the checkpoint layout, the engine's name, the wire's numbers, the CLI's entry (its names are
# looked up on use), and every subpackage's __init__.
RUNTIME_TORCH_FREE = (
    "runtime",
    "runtime.commands",
    "runtime.launch.failure",
    "runtime.launch.torchrun",
    "runtime.engines.choice",
    "runtime.state.folders",
    "runtime.execute.wire",
)

# Modules that must import without torch: the solver, the schedules, the plan and the base,
# and the cost pass's numbers-only modules.
TORCH_FREE_UNITS = ("solve", "schedule")
TORCH_FREE = (
    "partitioner.plan",
    "partitioner.orders",
    "partitioner.layout",
    "partitioner.units",
    "partitioner.errors",
    "partitioner.defaults",
    "partitioner.cost.nodecost",
    "partitioner.cost.comm",
    "partitioner.cost.devices",
    "partitioner.cost.precision",
    "partitioner.cost.calibration",
    "partitioner.search.settings",
)

# The partitioner modules allowed to import the runtime, inside functions only (importing the
# partitioner loads none of it): the CLI verifies and runs plans.  It does so through one module:
RUNTIME_IMPORTERS = {"partitioner.cli"}
RUNTIME_ENTRY = "runtime.commands"

# What the runtime must not import: the passes that solve and report, and the names that lead to them.
# (The plan it reads holds solve's BlockGraph and problem's gap helper; from cost/ it reads dtype names only.)
SOLVING_PASSES = (
    "partitioner.search",
    "partitioner.solve.ilp",
    "partitioner.solve.interval",
    "partitioner.solve.formulate",
    "partitioner.solve.coarsen",
    "partitioner.solve.scaledcosts",
    "partitioner.report",
    "partitioner.cost.nodes",
    "partitioner.cost.measured",
    "partitioner.cost.splitcost",
    "partitioner.cost.calibration",
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


def _dotted(path: Path) -> str:
    """The importable name: ``partitioner/solve/__init__.py`` is ``partitioner.solve``."""
    name = _module_name(path)
    return name.removesuffix(".__init__")


def _sources(package: str, root: Path | None = None) -> list[Path]:
    return sorted((root or ROOT).joinpath(package).rglob("*.py"))


def _unit(module: str, package: str = "partitioner") -> str | None:
    """The layer unit of a ``package`` module: its subpackage, or the flat module's name."""
    parts = module.split(".")
    if parts[0] != package:
        return None
    return parts[1] if len(parts) > 1 else "__init__"


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


# ----------------------------------------------------------------- the checkers


def _partitioner_imports(root: Path, package: str = "partitioner") -> dict[str, set[str]]:
    """Module -> the ``package`` modules it imports (any depth, TYPE_CHECKING included).

    The bare package name is left out: ``from partitioner import x`` imports ``x`` (and the
    package's ``__init__`` loads nothing eagerly but ``errors``; the runtime's, nothing).
    """
    return {_dotted(path): {n for n in _imports(path) if _unit(n, package) is not None and n != package}
            for path in _sources(package, root)}


def _upward_imports(root: Path, package: str = "partitioner",
                    layers: dict[str, int] | None = None) -> dict[str, list[str]]:
    """Every import of a module from a higher layer than the importer's; unplaced units count as upward."""
    layers = LAYERS if layers is None else layers
    found: dict[str, list[str]] = {}
    for module, names in _partitioner_imports(root, package).items():
        mine = layers.get(_unit(module, package) or "", -1)
        up = sorted(n for n in names if layers.get(_unit(n, package) or "", 99) > mine)
        if up:
            found[module] = up
    return found


def _unit_cycles(root: Path, package: str = "partitioner") -> list[list[str]]:
    """Import circles between units (subpackages and flat modules), through any number of others."""
    graph = nx.DiGraph()
    for module, names in _partitioner_imports(root, package).items():
        for name in names:
            a, b = _unit(module, package), _unit(name, package)
            if a and b and a != b:
                graph.add_edge(a, b)
    return [sorted(c) for c in nx.simple_cycles(graph)]


def _module_cycles(root: Path, package: str) -> list[list[str]]:
    """Import circles between modules of ``package`` (within a unit too); a ``__main__`` block's
    import of its own module (the module, not the ``__main__`` copy running) is no circle."""
    graph = nx.DiGraph()
    imports = _partitioner_imports(root, package)
    for module, names in imports.items():
        graph.add_edges_from((module, name) for name in names if name in imports and name != module)
    return [sorted(c) for c in nx.simple_cycles(graph)]


def _runtime_importers(root: Path) -> dict[str, list[str]]:
    """Partitioner modules (other than the allowed ones) that import the runtime."""
    found = {}
    for path in _sources("partitioner", root):
        names = sorted(n for n in _imports(path) if _within(n, "runtime"))
        if names and _dotted(path) not in RUNTIME_IMPORTERS:
            found[_dotted(path)] = names
    return found


def _runtime_entries(root: Path) -> dict[str, list[str]]:
    """Partitioner modules that import a runtime module other than ``RUNTIME_ENTRY`` (or the bare package)."""
    found = {}
    for path in _sources("partitioner", root):
        names = sorted(n for n in _imports(path) if _within(n, "runtime") and not _within(n, RUNTIME_ENTRY))
        if names:
            found[_dotted(path)] = names
    return found


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    for name, source in files.items():
        target = tmp_path / name
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(textwrap.dedent(source))
    return tmp_path


# ----------------------------------------------------------------- the layers


def test_every_unit_has_a_layer() -> None:
    units = {_unit(_dotted(path)) for path in _sources("partitioner")}
    assert units - set(LAYERS) == set(), "place the new subpackage or flat module in LAYERS"
    flat = [p for p in (ROOT / "partitioner").glob("*.py")]
    assert len(flat) <= 12, sorted(p.name for p in flat)


def test_no_pass_reaches_up() -> None:
    assert _upward_imports(ROOT) == {}


def test_no_import_circle_between_subpackages() -> None:
    assert _unit_cycles(ROOT) == []


def test_the_layer_checkers_catch_a_break(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    root = _tree(tmp_path, {
        "partitioner/solve/ilp.py": "from partitioner.search import planner\n",
        "partitioner/search/planner.py": "def f():\n    import partitioner.solve.ilp\n",
        "partitioner/cost/nodes.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..plan import Plan\n",
        "partitioner/plan.py": "from partitioner.cost import nodes\n",
        "partitioner/graph/ir.py": "def f():\n    import runtime.stage\n",
    })
    assert _upward_imports(root) == {
        "partitioner.solve.ilp": ["partitioner.search", "partitioner.search.planner"],
        "partitioner.cost.nodes": ["partitioner.plan", "partitioner.plan.Plan"],
    }
    assert sorted(map(sorted, _unit_cycles(root))) == [["cost", "plan"], ["search", "solve"]]
    assert _runtime_importers(root) == {"partitioner.graph.ir": ["runtime.stage"]}


# ----------------------------------------------------------------- the runtime's floors


def test_every_runtime_unit_has_a_floor() -> None:
    units = {_unit(_dotted(path), "runtime") for path in _sources("runtime")}
    assert units - set(RUNTIME_FLOORS) == set(), "place the new subpackage or flat module in RUNTIME_FLOORS"
    flat = {p.stem for p in (ROOT / "runtime").glob("*.py")}
    assert flat == {"__init__", "pipeline", "evaluate", "verify", "commands"}, \
        "a new runtime module goes into a subpackage"


def test_no_runtime_floor_reaches_up() -> None:
    assert _upward_imports(ROOT, "runtime", RUNTIME_FLOORS) == {}


def test_no_import_circle_in_the_runtime() -> None:
    assert _unit_cycles(ROOT, "runtime") == []
    assert _module_cycles(ROOT, "runtime") == []


def test_the_floor_checkers_catch_a_break(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    # An upward import, closing a circle between two floors:
    _tree(tmp_path, {"runtime/execute/runner.py": "def f():\n    from runtime.parallel import shard\n",
                     "runtime/parallel/shard.py": "from runtime.execute.runner import f\n"})
    # A circle inside one floor (checkpoint <-> weights, as it was), and a __main__ block importing its own module:
    root = _tree(tmp_path, {
        "runtime/state/weights.py": "def g():\n    from runtime.state.checkpoint import find\n",
        "runtime/state/checkpoint.py": "from runtime.state import weights\n",
        "runtime/launch/torchrun.py": "if __name__ == '__main__':\n    from runtime.launch.torchrun import main\n",
    })
    assert _upward_imports(root, "runtime", RUNTIME_FLOORS) == {
        "runtime.execute.runner": ["runtime.parallel", "runtime.parallel.shard"],
    }
    assert _unit_cycles(root, "runtime") == [["execute", "parallel"]]
    assert sorted(_module_cycles(root, "runtime")) == [
        ["runtime.execute.runner", "runtime.parallel.shard"],
        ["runtime.state.checkpoint", "runtime.state.weights"],
    ]


def test_the_runtime_entry_points_import_without_torch() -> None:
    packages = [_dotted(p) for p in _sources("runtime") if p.name == "__init__.py"]
    assert {"runtime.execute", "runtime.state", "runtime.parallel", "runtime.engines", "runtime.launch"} <= set(packages)
    loaded = _loaded_after("\n".join(f"import {m}" for m in (*RUNTIME_TORCH_FREE, *packages)), no_torch=True)
    assert "torch" not in loaded


# ----------------------------------------------------------------- torch-free layers


def _torch_free_modules() -> list[str]:
    modules = [_dotted(p) for unit in TORCH_FREE_UNITS for p in _sources(f"partitioner/{unit}")]
    return sorted({*modules, *TORCH_FREE})


def test_solver_schedules_and_plan_import_without_torch() -> None:
    modules = _torch_free_modules()
    assert {"partitioner.solve.ilp", "partitioner.solve.formulate", "partitioner.schedule.simulate"} <= set(modules)
    loaded = _loaded_after("\n".join(f"import {m}" for m in modules), no_torch=True)
    assert "torch" not in loaded


def test_the_torch_blocker_works() -> None:
    done = _python(_NO_TORCH + "import partitioner.graph.capture\n")
    assert done.returncode != 0 and "torch is not available here" in done.stderr


# ----------------------------------------------------------------- the runtime


def test_only_the_cli_imports_the_runtime() -> None:
    assert _runtime_importers(ROOT) == {}


def test_the_partitioner_reaches_the_runtime_only_through_its_commands() -> None:
    assert _runtime_entries(ROOT) == {}
    assert RUNTIME_ENTRY in _imports(ROOT / "partitioner" / "cli.py")  # the one way in is used, not vacuous


def test_the_entry_checker_catches_a_break(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    root = _tree(tmp_path, {
        "partitioner/cli.py": """
            def _runtime():
                import runtime.commands
                return runtime.commands
            def _verify():
                from runtime.verify import verify_plan
            def _run():
                from runtime import launch
            """,
        "partitioner/cost/splitcost.py": "def f():\n    from runtime.execute.splitbackward import SplitBackward\n",
        "partitioner/report/table.py": "def f():\n    from runtime.commands import verify_plan\n",
    })
    assert _runtime_entries(root) == {
        "partitioner.cli": ["runtime", "runtime.launch", "runtime.verify", "runtime.verify.verify_plan"],
        "partitioner.cost.splitcost": ["runtime.execute.splitbackward",
                                       "runtime.execute.splitbackward.SplitBackward"],
    }


def test_partitioner_does_not_load_the_runtime() -> None:
    modules = [_dotted(p) for p in _sources("partitioner")]
    modules = [m for m in modules if m not in RUNTIME_IMPORTERS and not m.endswith("__main__")]
    loaded = _loaded_after("\n".join(f"import {m}" for m in modules))
    assert [m for m in loaded if _within(m, "runtime")] == []


def test_runtime_never_imports_the_solving_passes() -> None:
    offenders = {
        _dotted(path): sorted(n for n in _imports(path) if _within(n, SOLVING_PASSES))
        for path in _sources("runtime")
    }
    assert {m: names for m, names in offenders.items() if names} == {}


def test_runtime_does_not_load_the_solving_passes() -> None:
    modules = [_dotted(p) for p in _sources("runtime")]
    loaded = _loaded_after("\n".join(f"import {m}" for m in modules))
    assert [m for m in loaded if _within(m, SOLVING_PASSES)] == []


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("import runtime.verify", {"runtime.verify"}),
        ("from runtime import launch", {"runtime", "runtime.launch"}),
        ("def f():\n    importlib.import_module('runtime.verify')", {"runtime.verify"}),
        ("from partitioner import compile", {"partitioner", "partitioner.compile"}),
        ("from .search import planner", {"partitioner.search", "partitioner.search.planner"}),
        ("from .solve.ilp import solve", {"partitioner.solve.ilp", "partitioner.solve.ilp.solve"}),
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
    assert "partitioner.search.planner" not in loaded


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
    from partitioner.search import planner

    assert partitioner.compile is planner.compile
    assert "compile" in dir(partitioner)
    with pytest.raises(AttributeError, match="no attribute 'nonexistent'"):
        partitioner.nonexistent  # noqa: B018
