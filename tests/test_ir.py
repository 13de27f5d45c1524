"""The IR vocabulary: value sizes, dtype names, and that plan files stay free of torch."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from partitioner.graph.ir import ValueInfo, dtype_from_name, dtype_itemsize, dtype_name

ROOT = Path(__file__).resolve().parent.parent


def test_nbytes() -> None:
    assert ValueInfo("tensor", (3, 5, 4), "float32").nbytes == 3 * 5 * 4 * 4
    assert ValueInfo("tensor", (2, 8), "int64").nbytes == 2 * 8 * 8
    assert ValueInfo("tensor", (7,), "bfloat16").nbytes == 14
    assert ValueInfo("tensor", (4, 4), "bool").nbytes == 16
    assert ValueInfo("tensor", (), "float64").nbytes == 8  # a scalar tensor
    assert ValueInfo("tensor", (0, 3), "float32").nbytes == 0
    assert ValueInfo("static", static=7).nbytes == 0
    assert ValueInfo("bundle").nbytes == 0
    assert ValueInfo("none").nbytes == 0


def test_dtype_names_round_trip() -> None:
    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.bool, torch.uint8):
        assert dtype_from_name(dtype_name(dtype)) is dtype
    assert dtype_name(torch.float32) == "float32"
    for bad in ("float33", "Tensor", "nn"):
        with pytest.raises(ValueError, match="unknown dtype"):
            dtype_from_name(bad)
        with pytest.raises(ValueError, match="unknown dtype"):
            dtype_itemsize(bad)


def test_itemsize_agrees_with_torch_for_every_dtype() -> None:
    dtypes = {v for v in vars(torch).values() if isinstance(v, torch.dtype)}
    assert len(dtypes) > 10
    for dtype in dtypes:
        assert dtype_itemsize(dtype_name(dtype)) == dtype.itemsize, dtype


def test_ir_and_plan_import_without_torch() -> None:
    # torch made unimportable, as on a machine without it: the plan and the graph helpers still load.
    code = (
        "import sys\n"
        "class _NoTorch:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'torch' or name.startswith('torch.'):\n"
        "            raise ImportError(name)\n"
        "sys.meta_path.insert(0, _NoTorch())\n"
        "import partitioner.graph.ir\n"
        "from partitioner.plan import example_plan\n"
        "plan = example_plan()\n"
        "assert sum(b.nbytes for s in plan.stages for b in s.outputs) == 32\n"
        "print('torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
