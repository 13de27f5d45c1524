"""Run one fuzz case: render its model file, plan it under its layout, verify the plan on CPU ranks.

:func:`run_case` never raises for the model's outcome; it returns a :class:`CaseResult`:

* ``ok``: the plan trains like the unpartitioned model (``runtime.verify``: loss,
  gradients, buffers and parameters after each of ``steps`` optimizer steps);
* ``refused``: the planner raised an :class:`~partitioner.errors.AutopartitionError`
  (a clear error, no plan); its reason is kept and grouped (:func:`reason_key`);
* ``mismatch``: the plan ran but trains differently (verify's MISMATCH verdict);
* ``crash``: the planner failed with any other exception (an internal error), or a
  plan it accepted failed to save, was refused by the runtime or failed on the ranks.

Costs are predicted for an ``h100`` (not measured), so a seed plans the same split on
every run and machine.  :data:`TIERS` holds the seed sets: ``default`` (the pytest tier,
``tests/test_fuzz.py``) and ``long`` (300 seeds, ``tools/fuzz_models.py --tier long``).

Example (run from the repository root; plans and spawns ranks)::

    from tools.fuzz.grammar import make_case
    from tools.fuzz.run import run_case
    result = run_case(make_case(3), Path("fuzz-case-3"))
    print(result.outcome, result.detail)
"""

from __future__ import annotations

import dataclasses
import re
import time
import traceback
from pathlib import Path
from typing import Any

from tools.fuzz.build import BATCH, write_model_file
from tools.fuzz.grammar import Case, Layout, patterns

__all__ = ["DEFAULT_SEEDS", "DEVICE", "FAILURES", "OUTCOMES", "TIERS", "CaseResult", "failure_kind", "reason_key",
           "run_case", "run_model_file"]

OUTCOMES = ("ok", "refused", "mismatch", "crash")
FAILURES = ("mismatch", "crash")
DEVICE = "h100"  # predicted costs: the same split on every run

# The default tier (tests/test_fuzz.py, about a minute on 2 cores): chosen greedily from the long tier's
# log so that together they cover every pattern, schedule, shard and recompute mode, dp 2 and tp 2, twice
# where they can (22 ... 236), plus two refused before solving (2, 29) and an input written in place (11).
DEFAULT_SEEDS: tuple[int, ...] = (22, 117, 74, 108, 293, 197, 229, 261, 179, 70, 253, 123, 236, 2, 29, 11)
TIERS: dict[str, tuple[int, ...]] = {"default": DEFAULT_SEEDS, "long": tuple(range(300))}


@dataclasses.dataclass
class CaseResult:
    """One case's outcome (:data:`OUTCOMES`), where it was decided and why, and what it took."""

    seed: int
    outcome: str
    phase: str  # "plan", "save", "verify"
    detail: str  # a refusal's reason, an error's first line, verify's verdict
    layout: str
    chosen: str = ""  # the plan's shape, schedule and micro-batches, when one was made
    diffs: dict[str, float] = dataclasses.field(default_factory=dict)  # loss, grad, param, buffer
    wall_s: float = 0.0
    patterns: tuple[str, ...] = ()
    error: str = ""  # the traceback of a crash
    plan_dir: str = ""
    model_file: str = ""

    @property
    def failed(self) -> bool:
        return self.outcome in FAILURES

    def line(self) -> str:
        """One progress line: seed, outcome, seconds, layout, the chosen plan and the detail."""
        diff = f" grad {self.diffs['grad']:.1e}" if "grad" in self.diffs else ""
        return (f"seed {self.seed:4d} {self.outcome:8s} {self.wall_s:5.1f}s  {self.layout:58s} "
                f"{self.chosen:28s}{diff}  {self.detail[:160]}")

    def to_json(self, case: Case) -> dict[str, Any]:
        record = dataclasses.asdict(self)
        record["patterns"] = list(self.patterns)
        record["spec"] = case.spec.to_json()
        record["layout_fields"] = dataclasses.asdict(case.layout)
        return record


def _first_line(text: str) -> str:
    return next((line.strip() for line in text.splitlines() if line.strip()), "")[:400]


def reason_key(detail: str) -> str:
    """A refusal's reason with its numbers and names blurred, so that like reasons group together."""
    text = re.sub(r"'[^']*'|\"[^\"]*\"|`[^`]*`", "'…'", detail)
    text = re.sub(r"\d+(\.\d+)?", "N", text)
    return text.split(". ")[0][:110]


_MISMATCH_KINDS = (("the ranks start from", "start state"), ("the loss differs", "loss"),
                   ("the loss matches but", "gradients"), ("but buffer", "buffers"), ("but parameter", "parameters"))


def failure_kind(result: CaseResult) -> str:
    """What went wrong, coarsely: ``mismatch: loss`` (or gradients, buffers, ...), ``crash: planner: KeyError``.

    >>> failure_kind(CaseResult(0, "mismatch", "verify", "MISMATCH: first at step 1 of 2: the loss differs by 1", ""))
    'mismatch: loss'
    """
    if result.outcome == "mismatch":
        return "mismatch: " + next((kind for text, kind in _MISMATCH_KINDS if text in result.detail), "other")
    if result.outcome == "crash":
        return "crash: " + ": ".join(part.strip() for part in result.detail.split(":")[:2])
    return result.outcome


def _chosen(plan: Any) -> str:
    text = f"{plan.pp}x{plan.dp}" + (f"x{plan.tp}" if plan.tp > 1 else "") + f" {plan.schedule}"
    if plan.chunks > 1:
        text += f" v{plan.chunks}"
    return text + f" M{plan.microbatches}"


def run_case(case: Case, case_dir: Path, *, steps: int = 2, timeout: float = 60.0, from_seed: bool = True) -> CaseResult:
    """Plan and verify ``case`` in ``case_dir`` (its model file and plan are left there).

    ``from_seed``: ``case`` is its seed's own (``make_case(seed)``): the model file says how to replay it.
    """
    model_path = write_model_file(case, Path(case_dir) / "model.py", from_seed=from_seed)
    result = run_model_file(model_path, case.layout, Path(case_dir), steps=steps, timeout=timeout)
    result.seed, result.patterns = case.seed, tuple(sorted(patterns(case.spec)))
    return result


def run_model_file(model_path: Path, layout: Layout, case_dir: Path, *, steps: int = 2,
                   timeout: float = 60.0) -> CaseResult:
    """Plan any model file (batch :data:`~tools.fuzz.build.BATCH`) under ``layout`` and verify the plan.

    The plan is written to ``case_dir / "plan"``; the outcome is classified as :func:`run_case`'s.
    """
    from partitioner.errors import AutopartitionError
    from partitioner.modelfile import load_model_file
    from partitioner.search.planner import compile
    from runtime.verify import verify

    start = time.perf_counter()
    result = CaseResult(-1, "crash", "plan", "", layout.label(), model_file=str(model_path))

    def done(outcome: str, detail: str, *, error: str = "") -> CaseResult:
        result.outcome, result.detail, result.error = outcome, detail, error
        result.wall_s = time.perf_counter() - start
        return result

    try:
        model_file = load_model_file(str(model_path))
        target = model_file.example_target(BATCH) if model_file.example_target is not None else None
        plan = compile(model_file.build(), model_file.example_inputs(BATCH), gpus=layout.gpus, pp=layout.pp,
                       dp=layout.dp, tp=layout.tp, microbatches=layout.microbatches, schedule=layout.schedule,
                       shard=layout.shard, recompute=layout.recompute, device=DEVICE, loss_fn=model_file.loss_fn,
                       target=target)
    except AutopartitionError as exc:
        return done("refused", _first_line(str(exc)))
    except Exception as exc:  # noqa: BLE001 - an internal error of the planner is a finding
        return done("crash", f"planner: {type(exc).__name__}: {_first_line(str(exc))}", error=traceback.format_exc())
    result.chosen = _chosen(plan)
    result.phase = "save"
    plan_dir = Path(case_dir) / "plan"
    try:
        plan.save(plan_dir)
    except Exception as exc:  # noqa: BLE001
        return done("crash", f"plan.save: {type(exc).__name__}: {_first_line(str(exc))}", error=traceback.format_exc())
    result.plan_dir = str(plan_dir)
    result.phase = "verify"
    try:
        verdict = verify(plan_dir, str(model_path), steps=steps, timeout=timeout)
    except Exception as exc:  # noqa: BLE001 - the planner accepted this plan: any failure to run it is a crash
        return done("crash", f"runtime: {type(exc).__name__}: {_first_line(str(exc))}", error=traceback.format_exc())
    result.diffs = {"loss": verdict.max_loss_diff, "grad": verdict.max_grad_diff, "param": verdict.max_param_diff,
                    "buffer": verdict.max_buffer_diff}
    return done("ok" if verdict.ok else "mismatch", _first_line(verdict.summary()))
