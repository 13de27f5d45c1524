#!/usr/bin/env bash
# tools/fetch_wheels.sh: download the wheels tools/gpu_check.sh needs on the GPU machine.
#
# The GPU machine (x86-64, Python 3.12, no network) lacks pulp and highspy, the planner's ILP
# solvers; everything else the check needs is preinstalled there. Run this here, once:
#   bash tools/fetch_wheels.sh            # into .whl/ (about 20 MB), which it git-ignores locally
#   WHEELS=/some/dir bash tools/fetch_wheels.sh
# then carry the folder with the device tool: run(command="bash tools/gpu_check.sh",
# carry=[".whl"], timeout_s=540). The versions are those of this checkout's environment when it
# has them (one version of each: two stop the install there).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
WHEELS=${WHEELS:-.whl}
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] && [ -z "${PYTHON:-}" ] && PY=.venv/bin/python

version() {  # NAME -> NAME==VERSION as installed here, else NAME
  local v
  v=$("$PY" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$1" 2>/dev/null) \
    && echo "$1==$v" || echo "$1"
}

mkdir -p "$WHEELS"
"$PY" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
    -d "$WHEELS" "$(version pulp)" "$(version highspy)"

# Keep the wheels out of git (the device tool sends untracked files that git does not ignore).
case "$(cd "$WHEELS" && pwd)" in
  "$PWD"/*)
    exclude=$(git rev-parse --git-path info/exclude)
    rel=/${WHEELS#./}/
    if ! git check-ignore -q "$WHEELS/x.whl" 2>/dev/null; then
      mkdir -p "$(dirname "$exclude")"
      echo "$rel" >> "$exclude"
      echo "added $rel to $exclude"
    fi
    ;;
esac
ls -l "$WHEELS"
echo "carry: ${WHEELS#./} (and run: bash tools/gpu_check.sh)"
