#!/usr/bin/env bash
# The fortieth session's one-off driver: the attention probe A/B first, then whole decode steps (tree / base).
# On an H100 the decode runs take --experts 160 and 1k only (an A/B, not a figure of record).
set -u
ROOT=$OUT
T0=$(date +%s)
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "$GPU" > "$ROOT/gpu.txt"
ORDER="decode attn"; R=1          # an H200: the record of the tree first, one round
if [[ "$GPU" == *H100* ]]; then export DS4_BENCH_ARGS="--experts 160" DS4_CONTEXTS=1024; ORDER="attn decode"; R=2; fi
ROUNDS=${ROUNDS:-$R}
for part in ${PARTS:-$ORDER}; do
    left=$((580 - ($(date +%s) - T0)))
    [ "$left" -lt 60 ] && { echo "skip $part: $left s left" >> "$ROOT/driver.txt"; continue; }
    mkdir -p "$ROOT/$part"
    case $part in
        attn) OUT=$ROOT/attn DS4_PARTS=attn DS4_RUN_BUDGET_S=$(( left < ${ACAP:-220} ? left : ${ACAP:-220} )) \
                  bash bench/dev/h200_pending.sh > "$ROOT/attn/driver.log" 2>&1 ;;
        decode) OUT=$ROOT/decode DS4_PARTS=decode,base DS4_ROUNDS=${ROUNDS:-2} DS4_GRAPH_ONLY=1 \
                  DS4_RUN_BUDGET_S=$left bash bench/dev/h200_pending.sh > "$ROOT/decode/driver.log" 2>&1 ;;
        route) OUT=$ROOT/route DS4_PARTS=route,lut DS4_RUN_BUDGET_S=$left \
                  bash bench/dev/h200_pending.sh > "$ROOT/route/driver.log" 2>&1 ;;
    esac
    rm -f "$ROOT/$part/all.tgz"
done
cd "$ROOT" && tar czf all.tgz --exclude=all.tgz . && cat */summary.txt
