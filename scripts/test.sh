#!/usr/bin/env bash
# Run the test suite in the project's virtual environment (created on first use).
#   bash scripts/test.sh [pytest args...]     e.g. bash scripts/test.sh -m 'not slow' -x
# Two pytest-xdist workers, a test file per worker at a time (a file's module-scoped rank runs
# start once): many tests wait on ranks, timeouts or subprocesses, so two overlap well on two
# cores. AUTOPARTITION_TEST_WORKERS=0 runs in this process (pdb, -x in order).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup_env.sh"   # also cds to the repo root
workers="${AUTOPARTITION_TEST_WORKERS:-2}"
if [[ "$workers" == "0" ]]; then
    exec .venv/bin/python -m pytest tests "$@"
fi
exec .venv/bin/python -m pytest tests -n "$workers" --dist loadfile "$@"
