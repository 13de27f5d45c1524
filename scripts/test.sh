#!/usr/bin/env bash
# Run the test suite in the project's virtual environment (created on first use).
#   bash scripts/test.sh [pytest args...]     e.g. bash scripts/test.sh -m 'not slow' -x
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup_env.sh"   # also cds to the repo root
exec .venv/bin/python -m pytest tests "$@"
