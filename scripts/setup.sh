#!/usr/bin/env bash
# Create .venv (if missing) and install ds4 with everything the tests, notebooks and CUDA compile checks need.
# Idempotent: a second run only re-checks the install. Usage: bash scripts/setup.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
# DS4_EXTRAS: the optional dependency groups; scripts/test.sh adds `train` (PyTorch, CPU build, for the trainer's
# tests), the main job does without it
EXTRAS=${DS4_EXTRAS:-cuda,notebooks,test}
stamp=.venv/.ds4-installed
want=$( (cat pyproject.toml constraints.txt; echo "$EXTRAS") | sha256sum | cut -d' ' -f1)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
    .venv/bin/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
    .venv/bin/python -m pip install -q -c constraints.txt -e ".[$EXTRAS]"
    echo "$want" > "$stamp"
fi
