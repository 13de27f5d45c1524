"""Train the example GPT through an autopartition plan: a script to copy.

Plan, then launch on as many ranks as the plan has (CPU ranks use gloo, GPUs NCCL)::

    autopartition examples/gpt.py --gpus 2 --batch-size 16 --microbatches 4 --out plan/
    autopartition run plan/ -- examples/train_gpt.py --steps 20
    autopartition run plan/ -- examples/train_gpt.py --steps 5 --trace trace.json --checkpoint gpt.pt
    autopartition run plan/ -- examples/train_gpt.py --steps 10 --save ckpt/
    autopartition run other_plan/ -- examples/train_gpt.py --steps 20 --resume ckpt/ --save ckpt/

``--trace`` writes a Chrome trace (one track per rank; open it in https://ui.perfetto.dev);
``--checkpoint`` writes the whole model's state dict, in the original parameter names,
loadable with ``build_model().load_state_dict(torch.load(path))``.
``--save DIR`` writes a sharded checkpoint at the end (model, AdamW state, step, plan;
every rank its own part) into ``DIR/step-N``, atomically, keeping the newest ``--keep``
steps; ``--resume DIR`` continues from the newest complete step there (or from one
``DIR/step-N``), under this plan or any other plan of the model (other pp, dp, split or
schedule): ``--steps`` counts from the start of training, so the run above trains steps
10 to 19, on the data an uninterrupted run of 20 steps would see (when both plans take
the same batch size).  ``--save`` is checked before the first step: a plan directory, a
file, or a path this job cannot write is refused at once (exit 2), not after training.
"""

import argparse
import sys
import time

import torch
from gpt import SEQ_LEN, GPTConfig, build_model, loss_fn

from partitioner.errors import AutopartitionError
from runtime import Pipeline
from runtime.launch.torchrun import plan_from_env
from runtime.state.checkpoint import DEFAULT_KEEP, check_save_directory

__all__ = ["batches", "main"]


def batches(batch_size: int, *, seed: int = 0):  # type: ignore[no-untyped-def]
    """Synthetic next-token data (the same stream on every rank, as the Pipeline expects)."""
    generator = torch.Generator().manual_seed(seed)
    while True:
        tokens = torch.randint(0, GPTConfig().vocab_size, (batch_size, SEQ_LEN + 1), generator=generator)
        yield (tokens[:, :-1],), tokens[:, 1:]  # inputs (B, T), target (B, T)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--plan", help="plan directory (default: the one `autopartition run` passes)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--trace", help="write a Chrome trace of the last steps here")
    parser.add_argument("--checkpoint", help="write the trained model's full state dict here")
    parser.add_argument("--save", metavar="DIR", help="write a sharded checkpoint here at the end (DIR/step-N)")
    parser.add_argument("--keep", type=int, default=DEFAULT_KEEP, metavar="K",
                        help=f"keep the newest K steps in --save DIR (default {DEFAULT_KEEP})")
    parser.add_argument("--resume", metavar="DIR", help="continue from the newest complete checkpoint here")
    args = parser.parse_args()
    try:
        _train(args)
    except AutopartitionError as exc:  # bad input: its message, exit 2 (as the autopartition CLI)
        print(f"error: {exc}", file=sys.stderr, flush=True)
        sys.exit(2)


def _train(args: argparse.Namespace) -> None:
    if args.save:
        check_save_directory(args.save)  # now, not after every step has run
    plan = plan_from_env(args.plan)
    torch.manual_seed(0)  # every rank builds the same initial model
    pipe = Pipeline(plan, build_model(), loss_fn, trace=args.trace is not None)
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=args.lr)
    data = batches(plan.batch_size)
    first = 0
    if args.resume:
        first = pipe.load_checkpoint(args.resume, optimizer=optimizer)
        for _ in range(first):  # the batches the saved steps took: the same stream as without a break
            next(data)
    for step in range(first, args.steps):
        start = time.perf_counter()
        inputs, target = next(data)
        loss = pipe.step(inputs, target)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if loss is not None and pipe.replica == 0 and pipe.tp_rank == 0:  # one line per step
            print(f"step {step:4d}  loss {loss.item():.4f}  {1e3 * (time.perf_counter() - start):.1f} ms", flush=True)
    if args.trace:
        written = pipe.write_trace(args.trace)
        if written:
            print(f"trace: {written}")
    if args.save:
        folder = pipe.save_checkpoint(args.save, optimizer=optimizer, step=max(first, args.steps), keep=args.keep)
        if pipe.rank == 0:
            print(f"saved: {folder} (step {max(first, args.steps)})", flush=True)
    if args.checkpoint:
        state = pipe.full_state_dict()
        if state is not None:
            torch.save(state, args.checkpoint)
            print(f"checkpoint: {args.checkpoint}")


if __name__ == "__main__":
    main()
