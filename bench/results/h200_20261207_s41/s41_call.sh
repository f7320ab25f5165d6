#!/usr/bin/env bash
# The forty-first session's driver: the fortieth session's prepared placements (s40_call2.sh: whole decode steps of
# the default stream placement, --attn-mixes early, --ffn-mixes late --shared-expert side, both; ROUNDS rounds),
# then bench/dev/h200_pending.sh's parts `tests` (tests/kernels/test_attention.py with DS4_REQUIRE_CUDA=1) and `attn`
# (the attention probe of the tree against ab_head/'s files, alternating). Everything returns as one all.tgz.
# Run from the repository root of a staged checkout (bench/dev/h200_stage.sh): bash
# bench/results/h200_20261207_s41/s41_call.sh
set -u
TOP=$OUT
T0=$(date +%s)
mkdir -p "$TOP/place" "$TOP/attn"
OUT=$TOP/place BUDGET=${PLACE_BUDGET:-330} bash bench/results/h200_20261207_s40/s40_call2.sh > "$TOP/place.log" 2>&1
rm -f "$TOP/place/all.tgz"
LEFT=$(( ${TOTAL:-570} - ($(date +%s) - T0) ))
OUT=$TOP/attn DS4_PARTS=tests,attn DS4_TEST_FILES=tests/kernels/test_attention.py DS4_TESTS_CAP=120 \
    DS4_RUN_BUDGET_S=$LEFT bash bench/dev/h200_pending.sh > "$TOP/attn.log" 2>&1
cat "$TOP/place/summary.txt" "$TOP/attn/summary.txt" > "$TOP/summary.txt" 2>/dev/null
cd "$TOP" && cat summary.txt && tar czf /tmp/all.tgz . && find . -mindepth 1 -delete && mv /tmp/all.tgz .
