#!/usr/bin/env bash
# Create .venv (if missing) and install ds4 with everything the tests, notebooks and CUDA compile checks need.
# Idempotent: a second run only re-checks the install. Usage: bash scripts/setup.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
stamp=.venv/.ds4-installed
want=$(cat pyproject.toml constraints.txt | sha256sum | cut -d' ' -f1)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
    .venv/bin/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
    .venv/bin/python -m pip install -q -c constraints.txt -e ".[cuda,notebooks,test,train]"
    echo "$want" > "$stamp"
fi
