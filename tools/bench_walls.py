"""The planner's wall time on the large commands, every degree on auto beside ``--tp 1``, one fresh process each.

    python tools/bench_walls.py                    # 70B/64, 405B/1,024 (batch 2,048), DeepSeek-V3/2,048
    python tools/bench_walls.py --only 70b         # one case
    python tools/bench_walls.py --tp auto          # without the --tp 1 runs

Each case runs ``autopartition MODEL ...`` as the docs give it (``python -m partitioner``), with
``--tp auto`` (the default) and then ``--tp 1``, and prints the wall seconds, the peak resident memory
and the layout chosen (from ``plan.json``). Run it on a quiet machine: the figures are wall times.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

__all__ = ["CASES", "main"]

ROOT = Path(__file__).resolve().parent.parent

CASES: dict[str, list[str]] = {
    "70b": ["examples/llama.py:llama3_70b", "--gpus", "64", "--gpus-per-node", "8", "--device", "h100",
            "--batch-size", "256", "--precision", "bf16-mixed"],
    "405b": ["examples/llama.py:llama3_405b", "--gpus", "1024", "--gpus-per-node", "8", "--device", "h100",
             "--batch-size", "2048", "--precision", "bf16-mixed"],
    "deepseek": ["examples/deepseek_v3.py:deepseek_v3_671b", "--gpus", "2048", "--device", "h800",
                 "--batch-size", "15360", "--precision", "bf16-mixed"],
}


def _run(args: list[str], out: Path) -> tuple[float, float, str]:
    """(wall seconds, peak resident GB of the child, the chosen layout) of one planner run."""
    start = time.perf_counter()
    child = subprocess.Popen([sys.executable, "-m", "partitioner", *args, "--out", str(out)], cwd=ROOT,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    assert child.stderr is not None
    errors = child.stderr.read()
    _, status, usage = os.wait4(child.pid, 0)  # this child's own peak, not the largest of all so far
    wall = time.perf_counter() - start
    peak = usage.ru_maxrss / 1e6  # KB -> GB
    if os.waitstatus_to_exitcode(status) != 0:
        return wall, peak, "failed: " + (errors.strip().splitlines() or ["?"])[-1]
    plan = json.loads((out / "plan.json").read_text())
    layout = f"pp {plan['pp']} x dp {plan['dp']} x tp {plan.get('tp', 1)}, ep {plan.get('ep', 1)}, " \
             f"{plan['schedule']}, M {plan['microbatches']}, step {plan['predicted']['step_s']:.1f} s"
    return wall, peak, layout


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default=",".join(CASES), help="comma-separated cases: " + ", ".join(CASES))
    parser.add_argument("--tp", default="auto,1", help="the --tp values to run, in order (default auto,1)")
    args = parser.parse_args(argv)
    print(f"{'case':10} {'--tp':5} {'wall':>8} {'peak RSS':>9}  layout chosen")
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.only.split(","):
            for tp in args.tp.split(","):
                wall, peak, layout = _run([*CASES[name], "--tp", tp], Path(tmp) / f"{name}-{tp}")
                print(f"{name:10} {tp:5} {wall:7.1f}s {peak:7.2f}GB  {layout}", flush=True)


if __name__ == "__main__":
    main()
