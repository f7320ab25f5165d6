#!/usr/bin/env bash
# The forty-second session's driver: the mHC probe of the tree against ab_head/ (the kernels/ files the session
# changed, as they were at its start), each alternating with the tree over two rounds (bench/dev/h200_pending.sh part
# `hc`), then the kernel tests of the changed kernels with DS4_REQUIRE_CUDA=1 and whole decode steps of the tree and
# of ab_head/ alternating (parts tests,decode,base; DS4_ROUNDS rounds, default 2, graph only; 1k and 64k on an H200,
# 1k with 160 experts on an H100). One all.tgz comes back. Run from the repository root of a staged checkout
# (bash bench/dev/h200_stage.sh 9265ec5 BASE). TOTAL caps the seconds (default 400).
set -u
TOP=$OUT
T0=$(date +%s)
left() { echo $(( ${TOTAL:-400} - ($(date +%s) - T0) )); }
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "$GPU" > "$TOP/gpu.txt"
BENCH=""; CTX=1024,65536
if [[ "$GPU" == *H100* ]]; then BENCH="--experts 160"; CTX=1024; fi
mkdir -p "$TOP/hc" "$TOP/rest"
OUT=$TOP/hc DS4_PARTS=hc DS4_RUN_BUDGET_S=$(( $(left) - 200 )) bash bench/dev/h200_pending.sh > "$TOP/hc.log" 2>&1
OUT=$TOP/rest DS4_PARTS=tests,decode,base DS4_TESTS_CAP=90 \
    DS4_TEST_FILES="tests/kernels/test_hc.py tests/kernels/test_vq_gemv.py tests/kernels/test_moe.py" \
    DS4_ROUNDS=${DS4_ROUNDS:-2} DS4_GRAPH_ONLY=1 DS4_CONTEXTS=$CTX DS4_BENCH_ARGS="$BENCH" \
    DS4_RUN_BUDGET_S=$(( $(left) - 15 )) bash bench/dev/h200_pending.sh > "$TOP/rest.log" 2>&1
for d in "$TOP/hc" "$TOP/rest"; do echo "== $d"; cat "$d/summary.txt"; done > "$TOP/summary.txt" 2>/dev/null
rm -f "$TOP"/hc/all.tgz "$TOP"/rest/all.tgz
cd "$TOP" && cat summary.txt && tar czf /tmp/all.tgz . && find . -mindepth 1 -delete && mv /tmp/all.tgz .
