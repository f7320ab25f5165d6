#!/usr/bin/env bash
# The test command: install what the tests need, then run the whole suite on the CPU
# (CUDA kernels under Numba's simulator and compiled for sm_90 without a GPU).
# Usage: bash scripts/test.sh [pytest args]   (with no args: the whole suite as DS4_TEST_SHARDS processes, default 2)
set -euo pipefail
cd "$(dirname "$0")/.."
# tests/server/test_chat_page.py drives Debian's headless Chromium (it fails, not skips, without it)
if ! command -v chromium >/dev/null 2>&1; then
    SUDO=; [ "$(id -u)" -eq 0 ] || SUDO=sudo
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq chromium >/dev/null
fi
DS4_EXTRAS=cuda,notebooks,test,train bash scripts/setup.sh
if [ "$#" -gt 0 ] || [ "${DS4_TEST_SHARDS:-2}" -le 1 ]; then
    set +e
    .venv/bin/python -m pytest -q "$@"
    rc=$?
    set -e
    if [ "$rc" -eq 5 ]; then
        echo "scripts/test.sh: pytest collected no tests: that is a failure, not a pass" >&2
        exit 1
    fi
    exit "$rc"
fi
# The whole suite: DS4_TEST_SHARDS (default 2) pytest processes side by side, each on whole test files
# (tests/shards.py balances them with tests/shard_weights.tsv). Shard 0 prints as it runs, the others' output
# follows when they end; each has its own temporary directory, and only shard 0 keeps pytest's cache.
n=${DS4_TEST_SHARDS:-2}
# One OpenBLAS thread a shard: its idle threads spin, and two shards of two threads each on two cores ran the CPU
# engine's tests 3.7x slower (two processes of the forced-tool server tests side by side: 113 s; with one OpenBLAS
# thread each 30 s; with OMP_WAIT_POLICY=PASSIVE alone 132 s)
export OPENBLAS_NUM_THREADS=${OPENBLAS_NUM_THREADS:-1}
work=$(mktemp -d)
pids=()
trap 'kill "${pids[@]}" 2>/dev/null || true; rm -rf "$work"' EXIT
start=$(date +%s)
for ((i = 1; i < n; i++)); do
    DS4_TEST_SHARD="$i/$n" .venv/bin/python -m pytest -q -p no:cacheprovider --basetemp="$work/tmp$i" \
        >"$work/shard$i.log" 2>&1 &
    pids+=($!)
done
set +e
DS4_TEST_SHARD="0/$n" .venv/bin/python -m pytest -q --basetemp="$work/tmp0"
rcs=($?)
for ((i = 1; i < n; i++)); do
    wait "${pids[i - 1]}"
    rcs+=($?)
done
set -e
for ((i = 1; i < n; i++)); do
    echo "=== scripts/test.sh: shard $i of $n (DS4_TEST_SHARD=$i/$n), exit status ${rcs[i]}"
    cat "$work/shard$i.log"
done
echo "scripts/test.sh: $n shards in $(($(date +%s) - start)) s, exit statuses ${rcs[*]} (5: collected no tests)"
failed=0 empty=0
for rc in "${rcs[@]}"; do
    if [ "$rc" -eq 5 ]; then empty=$((empty + 1)); elif [ "$rc" -ne 0 ]; then failed=1; fi
done
if [ "$empty" -eq "$n" ]; then
    echo "scripts/test.sh: pytest collected no tests: that is a failure, not a pass" >&2
    exit 1
fi
exit "$failed"
