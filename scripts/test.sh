#!/usr/bin/env bash
# The test command: install what the tests need, then run the whole suite on the CPU
# (CUDA kernels under Numba's simulator and compiled for sm_90 without a GPU).
# Usage: bash scripts/test.sh [pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
# tests/server/test_chat_page.py drives Debian's headless Chromium (it fails, not skips, without it)
if ! command -v chromium >/dev/null 2>&1; then
    SUDO=; [ "$(id -u)" -eq 0 ] || SUDO=sudo
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq chromium >/dev/null
fi
DS4_EXTRAS=cuda,notebooks,test,train bash scripts/setup.sh
set +e
.venv/bin/python -m pytest -q "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
    echo "scripts/test.sh: pytest collected no tests: that is a failure, not a pass" >&2
    exit 1
fi
exit "$rc"
