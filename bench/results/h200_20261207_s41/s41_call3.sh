#!/usr/bin/env bash
# The forty-first session's short driver (for a call with little device time left): test_attention.py with
# DS4_REQUIRE_CUDA=1, then the attention probe of the tree and of ab_head/ (6eaab2f) alternating over two rounds
# (bench/dev/h200_pending.sh parts tests,attn within BUDGET seconds, default 200). One all.tgz comes back.
set -u
TOP=$OUT
mkdir -p "$TOP/attn"
OUT=$TOP/attn AB_HEAD=ab_head DS4_PARTS=tests,attn DS4_TEST_FILES=tests/kernels/test_attention.py DS4_TESTS_CAP=60 \
    DS4_RUN_BUDGET_S=${BUDGET:-200} bash bench/dev/h200_pending.sh > "$TOP/attn.log" 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader > "$TOP/gpu.txt"
cd "$TOP" && cat attn/summary.txt && rm -f attn/all.tgz && tar czf /tmp/all.tgz . && find . -mindepth 1 -delete \
    && mv /tmp/all.tgz .
