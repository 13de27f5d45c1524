#!/usr/bin/env bash
# End-to-end demo on this machine's CPU ranks (gloo):
#   1. plan the example GPT for 4 GPUs, letting the planner choose pp x dp, the
#      micro-batches' schedule (GPipe, 1F1B, interleaved, ZB-H1, ZB-V) and the split;
#   2. verify that plan against the unpartitioned model on 4 CPU ranks;
#   3. train it for 3 steps with torchrun (autopartition run), saving a sharded checkpoint;
#   4. plan it again as 4 stages x 1 replica with 1F1B and resume the checkpoint there
#      (steps 3 and 4 give the losses an uninterrupted run gives), writing a trace;
#   5. fit the planner's costs to that trace (autopartition calibrate): what this plan's
#      step is predicted to be under the fit, next to the measured steps above;
#   6. print the saved plan's report (autopartition show).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup_env.sh"   # also cds to the repo root

out=/tmp/autopartition-demo
rm -rf "$out"

echo "== plan: examples/gpt.py on 4 GPUs, shape and schedule chosen by the planner =="
.venv/bin/autopartition examples/gpt.py --gpus 4 --batch-size 16 --microbatches 4 --out "$out/auto"

echo
echo "== verify: run the chosen plan on 4 CPU ranks and compare with the unpartitioned model =="
.venv/bin/autopartition verify "$out/auto" --model examples/gpt.py

echo
echo "== run: train 3 steps on the chosen plan, write a sharded checkpoint =="
.venv/bin/autopartition run "$out/auto" -- examples/train_gpt.py --steps 3 \
    --save "$out/ckpt" 2>&1 | grep -v -e '^\*\*\*' -e OMP_NUM_THREADS

echo
echo "== plan: 4 stages x 1 replica, 1F1B; resume the checkpoint on it for steps 3 and 4, with a trace =="
.venv/bin/autopartition examples/gpt.py --gpus 4 --pp 4 --batch-size 16 --microbatches 4 \
    --schedule 1f1b --out "$out/plan" --quiet > /dev/null
.venv/bin/autopartition run "$out/plan" -- examples/train_gpt.py --steps 5 \
    --resume "$out/ckpt" --trace "$out/trace.json" 2>&1 | grep -v -e '^\*\*\*' -e OMP_NUM_THREADS

echo
echo "== calibrate: the plan's costs against its run's trace (plan again with --calibration FILE) =="
.venv/bin/autopartition calibrate "$out/plan" "$out/trace.json" -o "$out/calibration.json"

echo
echo "== show: the report, from the saved plan alone =="
.venv/bin/autopartition show "$out/plan"
