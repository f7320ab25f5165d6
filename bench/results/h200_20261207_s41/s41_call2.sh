#!/usr/bin/env bash
# The forty-first session's second driver: the attention probe of the tree against two sets of files, each
# alternating with the tree over two rounds (bench/dev/h200_pending.sh part `attn` with AB_HEAD set): ab_head/
# (6eaab2f, the session's start), then test_attention.py with DS4_REQUIRE_CUDA=1 and whole decode steps of the
# tree and of ab_head/ alternating (parts decode,base, two rounds, graph only), then, where that folder exists,
# ab_v2/ (another set of kernels/ files, e.g. 8546c28's attention.py) as time allows. One all.tgz comes back.
# Run from the repository root of a staged checkout. (a4dd377's value kernel was timed by the first call's `attn`.)
set -u
TOP=$OUT
T0=$(date +%s)
left() { echo $(( ${TOTAL:-400} - ($(date +%s) - T0) )); }
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "$GPU" > "$TOP/gpu.txt"
BENCH=""; CTX=1024,65536
if [[ "$GPU" == *H100* ]]; then BENCH="--experts 160"; CTX=1024; fi
attn() {   # attn DIR: the attention probe of the tree and of DIR's files, alternating over two rounds
    mkdir -p "$TOP/attn_$1"
    OUT=$TOP/attn_$1 AB_HEAD=$1 DS4_PARTS=attn DS4_RUN_BUDGET_S=$2 bash bench/dev/h200_pending.sh \
        > "$TOP/attn_$1.log" 2>&1
}
attn ab_head $(( $(left) - 170 ))
mkdir -p "$TOP/rest"
OUT=$TOP/rest DS4_PARTS=tests,decode,base DS4_TEST_FILES=tests/kernels/test_attention.py DS4_TESTS_CAP=60 \
    DS4_ROUNDS=2 DS4_GRAPH_ONLY=1 DS4_CONTEXTS=$CTX DS4_BENCH_ARGS="$BENCH" DS4_RUN_BUDGET_S=$(( $(left) - 60 )) \
    bash bench/dev/h200_pending.sh > "$TOP/rest.log" 2>&1
[ -d ab_v2 ] && [ "$(left)" -gt 60 ] && attn ab_v2 "$(left)"
for d in "$TOP"/attn_ab_* "$TOP/rest"; do [ -d "$d" ] && { echo "== $d"; cat "$d/summary.txt"; }; done \
    > "$TOP/summary.txt" 2>/dev/null
cd "$TOP" && cat summary.txt && tar czf /tmp/all.tgz . && find . -mindepth 1 -delete && mv /tmp/all.tgz .
