#!/usr/bin/env bash
# End-to-end demo: plan the example GPT for 4 GPUs, verify the plan on CPU ranks
# against the unpartitioned model, and print the saved plan's report.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup_env.sh"   # also cds to the repo root

plan=/tmp/autopartition-demo/plan

echo "== plan: examples/gpt.py on 4 GPUs =="
.venv/bin/autopartition examples/gpt.py --gpus 4 --batch-size 16 --microbatches 4 --out "$plan"

echo
echo "== verify: run the plan on CPU ranks and compare with the unpartitioned model =="
.venv/bin/autopartition verify "$plan" --model examples/gpt.py

echo
echo "== show: the report, from the saved plan alone =="
.venv/bin/autopartition show "$plan"
