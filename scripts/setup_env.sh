#!/usr/bin/env bash
# Create (or refresh) the project's virtual environment in .venv at the repo root.
#
#   bash scripts/setup_env.sh         # run it
#   source scripts/setup_env.sh       # or source it (scripts/test.sh and scripts/demo.sh do)
#
# Idempotent: installs CPU torch==2.13.0 first (pinned by constraints.txt), then the
# package in editable mode with its dev extras. Skips all work while the stamp file
# .venv/.autopartition-stamp is newer than pyproject.toml and constraints.txt.
#
# Environment:
#   PYTHON                      interpreter used to create the venv (default: python3)
#   AUTOPARTITION_TORCH_INDEX   optional --index-url for the torch install, e.g. a CPU wheel index
#   AUTOPARTITION_FORCE_SETUP=1 reinstall even when the stamp is fresh

_autopartition_setup() {
    local root
    root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)" || return 1
    cd "$root" || return 1

    local venv=".venv"
    local stamp="$venv/.autopartition-stamp"

    if [[ -x "$venv/bin/python" && -f "$stamp" && "${AUTOPARTITION_FORCE_SETUP:-0}" != "1" \
          && "$stamp" -nt pyproject.toml && "$stamp" -nt constraints.txt ]]; then
        return 0
    fi

    if [[ ! -x "$venv/bin/python" ]]; then
        echo "setup_env: creating $venv with ${PYTHON:-python3}" >&2
        "${PYTHON:-python3}" -m venv "$venv" || return 1
    fi

    local torch_index=()
    if [[ -n "${AUTOPARTITION_TORCH_INDEX:-}" ]]; then
        torch_index=(--index-url "$AUTOPARTITION_TORCH_INDEX")
    fi

    echo "setup_env: installing torch==2.13.0 and autopartition[dev] into $venv" >&2
    "$venv/bin/pip" install -q -c constraints.txt ${torch_index[@]+"${torch_index[@]}"} torch==2.13.0 || return 1
    "$venv/bin/pip" install -q -c constraints.txt -e '.[dev]' || return 1

    touch "$stamp"
}

if ! _autopartition_setup; then
    echo "setup_env: failed to set up $(pwd)/.venv" >&2
    unset -f _autopartition_setup
    # 'return' when sourced, 'exit' when run as a script.
    return 1 2>/dev/null || exit 1
fi
unset -f _autopartition_setup
