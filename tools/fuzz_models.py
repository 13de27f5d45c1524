"""Fuzz the partitioner: random valid models x random layouts, each verified on CPU ranks or refused.

Commands (from the repository root)::

    .venv/bin/python tools/fuzz_models.py                                  # the default tier (tests/test_fuzz.py's seeds)
    .venv/bin/python tools/fuzz_models.py --tier long --out fuzz-out       # 300 seeds (seeds 0:300)
    .venv/bin/python tools/fuzz_models.py --seeds 0:100 --out fuzz-out     # a chunk of them; the log is appended to
    .venv/bin/python tools/fuzz_models.py --seeds 17:18 --out fuzz-out --reduce   # one seed, failures shrunk
    .venv/bin/python tools/fuzz_models.py --summarise fuzz-out             # the table over every case logged there
    .venv/bin/python tools/fuzz_models.py --seeds 0:100 --exclude inplace_input,functional_weight   # around known bugs

Each seed draws a model from the grammar of :mod:`tools.fuzz.grammar` (linear and MLP
blocks, layer norms, attention, convolution + BatchNorm, reused modules, weights read
through functionals, tied aliases, in-place ops on inputs and views, skips, several inputs,
dict outputs, buffers written in forward, dropout, token ids and LM heads) and a layout
(pp, dp, tp, schedule, micro-batches, shard, recompute; at most 4 CPU ranks), plans the
model under it (costs predicted for an h100) and verifies the plan against the unpartitioned
model over 2 optimizer steps (``runtime.verify``).  Outcomes: ``ok``, ``refused`` (the
planner's clear error), ``mismatch`` and ``crash`` (the last two are failures: exit code 1).

``--out DIR`` appends one JSON line per case to ``DIR/cases.jsonl`` (seed, model spec,
layout, outcome, detail, largest differences, wall time) and keeps, for each failure,
``DIR/failures/seed-N/`` with the model file (``model.py``, standalone), the plan
(``plan/``), ``case.json``, ``error.txt`` and the ranks' tracebacks (``ranks.log``); with ``--reduce`` also ``reduced.py`` (and
``reduced-plan/``): the smallest case that still fails the same way.  A summary table
(counts per outcome, per pattern and per schedule, refusal reasons grouped) ends the run.
``--exclude`` rewrites every model without the named patterns (:func:`tools.fuzz.reduce.strip_patterns`),
to look for other bugs while known ones are open.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tools.fuzz.build import write_model_file
from tools.fuzz.grammar import PATTERNS, SCHEDULES, Case, make_case
from tools.fuzz.reduce import reduce_case, strip_patterns
from tools.fuzz.run import FAILURES, OUTCOMES, TIERS, CaseResult, failure_kind, reason_key, run_case

__all__ = ["main", "parse_seeds", "summary"]


def parse_seeds(text: str) -> list[int]:
    """``"0:300"`` (a range), ``"5"`` or ``"1,4,9"``.

    >>> parse_seeds("3:6"), parse_seeds("7"), parse_seeds("1,4")
    ([3, 4, 5], [7], [1, 4])
    """
    if ":" in text:
        start, _, stop = text.partition(":")
        return list(range(int(start), int(stop)))
    return [int(part) for part in text.split(",") if part.strip()]


def _row(name: str, counts: collections.Counter[str], width: int) -> str:
    return f"{name:{width}s} " + " ".join(f"{counts.get(o, 0):8d}" for o in OUTCOMES) + f" {sum(counts.values()):8d}"


def summary(records: Sequence[dict[str, Any]]) -> str:
    """Counts per outcome, per pattern and per schedule (asked for, and chosen), refusal reasons grouped."""
    outcomes = collections.Counter(r["outcome"] for r in records)
    head = f"{'':22s} " + " ".join(f"{o:>8s}" for o in OUTCOMES) + f" {'cases':>8s}"
    lines = [f"{len(records)} cases: " + ", ".join(f"{outcomes.get(o, 0)} {o}" for o in OUTCOMES), "", head,
             _row("all", outcomes, 22), "", "per pattern:"]
    for pattern in PATTERNS:
        lines.append(_row(pattern, collections.Counter(r["outcome"] for r in records if pattern in r["patterns"]),
                          22))
    lines += ["", "per schedule asked for:"]
    for schedule in SCHEDULES:
        lines.append(_row(schedule, collections.Counter(
            r["outcome"] for r in records if r["layout_fields"]["schedule"] == schedule), 22))
    chosen = collections.Counter(r["chosen"].split()[1] for r in records if r.get("chosen"))
    lines += ["", "schedules planned: " + ", ".join(f"{k} {v}" for k, v in sorted(chosen.items()))]
    reasons = collections.Counter(reason_key(r["detail"]) for r in records if r["outcome"] == "refused")
    if reasons:
        lines += ["", "refused, by reason:"] + [f"  {n:4d}  {reason}" for reason, n in reasons.most_common()]
    failures = [r for r in records if r["outcome"] in FAILURES]
    if failures:
        lines += ["", "failures:"] + [f"  seed {r['seed']:4d} {r['outcome']:8s} {r['layout']}: {r['detail'][:200]}"
                                      for r in failures]
    return "\n".join(lines)


def _same_failure(first: CaseResult) -> Callable[[CaseResult], bool]:
    """A predicate: a case fails as ``first`` did (:func:`~tools.fuzz.run.failure_kind`)."""
    kind = failure_kind(first)
    return lambda result: failure_kind(result) == kind


def _keep_failure(case: Case, result: CaseResult, case_dir: Path, out: Path, *, reduce: bool, steps: int) -> None:
    kept = out / "failures" / f"seed-{case.seed}"
    if kept.exists():
        shutil.rmtree(kept)
    shutil.copytree(case_dir, kept)
    (kept / "case.json").write_text(json.dumps(case.to_json(), indent=1))
    (kept / "error.txt").write_text(f"{result.outcome}: {result.detail}\n\n{result.error}")
    log = re.search(r"traceback: (\S+\.log)", result.error)  # the ranks' tracebacks (runtime.launch.failure)
    if log and Path(log.group(1)).exists():
        shutil.copy(log.group(1), kept / "ranks.log")
    if not reduce:
        return
    same = _same_failure(result)
    n = 0

    def fails(candidate: Case) -> bool:
        nonlocal n
        n += 1
        with tempfile.TemporaryDirectory(prefix="autopartition-reduce-") as work:
            return bool(same(run_case(candidate, Path(work), steps=steps, from_seed=False)))

    small = reduce_case(case, fails, progress=lambda line: print(f"  {line}", file=sys.stderr, flush=True))
    final = run_case(small, kept / "reduced-case", steps=steps, from_seed=False)
    write_model_file(small, kept / "reduced.py", notes=f"Reduced from seed {case.seed} in {n} runs: "
                     f"{final.outcome}: {final.detail}", from_seed=False)
    (kept / "reduced-case.json").write_text(json.dumps(small.to_json(), indent=1))
    print(f"  reduced in {n} runs to {len(small.spec.blocks)} blocks, {small.layout.label()}: {final.detail[:160]}",
          file=sys.stderr, flush=True)


def _read_log(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    by_seed: dict[int, dict[str, Any]] = {}
    for line in path.read_text().splitlines():
        if line.strip():
            record = json.loads(line)
            by_seed[record["seed"]] = record  # the latest run of a seed
    return [by_seed[s] for s in sorted(by_seed)]


def run_seeds(seeds: Iterable[int], *, out: Path | None, reduce: bool, steps: int,
              exclude: Sequence[str] = ()) -> list[dict[str, Any]]:
    """Run every seed (one at a time), log and keep failures under ``out``; the records of this run."""
    records: list[dict[str, Any]] = []
    log = out / "cases.jsonl" if out is not None else None
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
    for seed in seeds:
        case = make_case(seed)
        if exclude:
            case = dataclasses.replace(case, spec=strip_patterns(case.spec, exclude))
        with tempfile.TemporaryDirectory(prefix=f"autopartition-fuzz-{seed}-") as work:
            result = run_case(case, Path(work), steps=steps, from_seed=not exclude)
            print(result.line(), file=sys.stderr, flush=True)
            if result.failed and out is not None:
                _keep_failure(case, result, Path(work), out, reduce=reduce, steps=steps)
        record = result.to_json(case)
        records.append(record)
        if log is not None:
            with log.open("a") as handle:
                handle.write(json.dumps(record) + "\n")
    return records


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--seeds", help="seeds: A:B (a range), N, or N,M,... (default: the tier's)")
    parser.add_argument("--tier", choices=sorted(TIERS), default="default", help="default: the pytest tier's seeds; "
                        "long: seeds 0:300")
    parser.add_argument("--out", type=Path, help="append a JSON line per case to OUT/cases.jsonl; keep failures")
    parser.add_argument("--reduce", action="store_true", help="shrink each failure (needs --out)")
    parser.add_argument("--steps", type=int, default=2, help="optimizer steps verified per case (default 2)")
    parser.add_argument("--exclude", default="", help="comma-separated patterns to strip from every model")
    parser.add_argument("--summarise", type=Path, metavar="DIR", help="only print the table of DIR/cases.jsonl")
    args = parser.parse_args(argv)
    if args.summarise is not None:
        records = _read_log(args.summarise / "cases.jsonl")
        if not records:
            parser.error(f"no cases logged in {args.summarise / 'cases.jsonl'}")
        print(summary(records))
        return 0
    if args.reduce and args.out is None:
        parser.error("--reduce keeps the reduced case under --out DIR: give --out")
    seeds = parse_seeds(args.seeds) if args.seeds else list(TIERS[args.tier])
    start = time.perf_counter()
    exclude = [p for p in args.exclude.split(",") if p]
    unknown = sorted(set(exclude) - set(PATTERNS))
    if unknown:
        parser.error(f"--exclude: unknown patterns {', '.join(unknown)}; choose from {', '.join(PATTERNS)}")
    records = run_seeds(seeds, out=args.out, reduce=args.reduce, steps=args.steps, exclude=exclude)
    print(summary(records))
    print(f"\n{len(records)} cases in {time.perf_counter() - start:.0f} s")
    return 1 if any(r["outcome"] in FAILURES for r in records) else 0


if __name__ == "__main__":
    raise SystemExit(main())
