#!/usr/bin/env bash
# The forty-second session's third driver (no H200 came for the record): the CUDA engine tests with
# DS4_REQUIRE_CUDA=1 (graph == eager, byte identity, speculative) on the tree, then its per-op trace without
# programmatic edges and the trace's critical path (bench/dev/h200_pending.sh parts engine,trace; on an H100 the V4.1
# run takes --experts 160). One all.tgz comes back. TOTAL caps the seconds (default 330).
set -u
TOP=$OUT
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "$GPU" > "$TOP/gpu.txt"
BENCH=""
if [[ "$GPU" == *H100* ]]; then BENCH="--experts 160"; fi
OUT=$TOP DS4_PARTS=engine,trace DS4_ENGINE_CAP=${ENGINE_CAP:-190} DS4_TRACE_CAP=120 DS4_BENCH_ARGS="$BENCH" \
    DS4_RUN_BUDGET_S=${TOTAL:-330} bash bench/dev/h200_pending.sh > "$TOP/driver.log" 2>&1
cd "$TOP" && cat summary.txt && rm -f all.tgz && gzip -f timeline_pdl0.jsonl 2>/dev/null; \
    tar czf /tmp/all.tgz . && find . -mindepth 1 -delete && mv /tmp/all.tgz .
