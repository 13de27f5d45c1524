#!/usr/bin/env bash
# End-to-end demo on this machine's CPU ranks (gloo):
#   1. plan the example GPT for 4 GPUs, letting the planner choose pp x dp;
#   2. plan it again as 2 pipeline stages x 2 replicas (--pp 2), the shape a
#      bigger model would get, verify that plan against the unpartitioned model,
#      and train it for a few steps with torchrun (autopartition run);
#   3. print the saved plan's report (autopartition show).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup_env.sh"   # also cds to the repo root

out=/tmp/autopartition-demo
rm -rf "$out"

echo "== plan: examples/gpt.py on 4 GPUs, shape chosen by the planner =="
.venv/bin/autopartition examples/gpt.py --gpus 4 --batch-size 16 --microbatches 4 --out "$out/auto"

echo
echo "== plan: 2 stages x 2 replicas, 1F1B =="
.venv/bin/autopartition examples/gpt.py --gpus 4 --pp 2 --batch-size 16 --microbatches 4 \
    --schedule 1f1b --out "$out/plan" --quiet > /dev/null

echo "== verify: run the plan on 4 CPU ranks and compare with the unpartitioned model =="
.venv/bin/autopartition verify "$out/plan" --model examples/gpt.py

echo
echo "== run: train 5 steps with torchrun, write a trace and a checkpoint =="
.venv/bin/autopartition run "$out/plan" -- examples/train_gpt.py --steps 5 \
    --trace "$out/trace.json" --checkpoint "$out/gpt.pt" 2>&1 | grep -v -e '^\*\*\*' -e OMP_NUM_THREADS

echo
echo "== show: the report, from the saved plan alone =="
.venv/bin/autopartition show "$out/plan"
