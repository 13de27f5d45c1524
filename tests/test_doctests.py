"""Every docstring example of the product (``partitioner``, ``runtime``) and of ``tools`` runs and passes.

A test module rather than ``--doctest-modules`` so that ``pytest tests`` (what
``scripts/test.sh`` runs) includes them.  Modules are found with ``pkgutil``, so a new
module's examples are picked up without editing this file; ``__main__`` modules are
skipped (importing one runs its program).
"""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

_PACKAGES = ("partitioner", "runtime", "tools")


def _modules() -> list[str]:
    names = []
    for package in _PACKAGES:
        found = importlib.import_module(package)
        names.append(package)
        for info in pkgutil.walk_packages(found.__path__, prefix=f"{package}."):
            if info.name.rpartition(".")[2] != "__main__":
                names.append(info.name)
    return sorted(names)


_MODULES = _modules()


@pytest.mark.parametrize("name", _MODULES)
def test_examples_pass(name: str) -> None:
    module = importlib.import_module(name)
    finder = doctest.DocTestFinder(exclude_empty=True)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    for test in finder.find(module, name):
        runner.run(test)
    result = runner.summarize(verbose=False)
    assert result.failed == 0, (
        f"{result.failed} of {result.attempted} examples in {name} failed (output above)"
    )


def test_examples_are_found() -> None:
    """Discovery works: the solver's modules alone have dozens of examples."""
    finder = doctest.DocTestFinder(exclude_empty=True)
    count = sum(
        len(t.examples) for n in _MODULES for t in finder.find(importlib.import_module(n), n)
    )
    assert count >= 27, count
