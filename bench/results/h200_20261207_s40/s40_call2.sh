#!/usr/bin/env bash
# The fortieth session's second driver (prepared, not run): whole decode steps of the default stream placement, the
# attention's mixes early (--attn-mixes early), the FFN's mixes after the routing with the shared expert after it too
# (--ffn-mixes late --shared-expert side), and both, in turn, ROUNDS (default 2) times; then the placement test on
# the GPU. Run from the repository root of a staged checkout: bash bench/results/h200_20261207_s40/s40_call2.sh
set -u
ROOT=$OUT
T0=$(date +%s)
pip install -q --no-deps --target /tmp/site .whl/*.whl > "$ROOT/setup.log" 2>&1
export PYTHONPATH="$PWD:/tmp/site" DS4_KERNEL_CACHE=/tmp/kcache PYTHONUNBUFFERED=1 PYTEST_DISABLE_PLUGIN_AUTOLOAD=1
export NUMBA_CUDA_LOW_OCCUPANCY_WARNINGS=0
unset NUMBA_ENABLE_CUDASIM
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "$GPU" > "$ROOT/gpu.txt"
EXTRA=(); CTX=1024,65536
if [[ "$GPU" == *H100* ]]; then EXTRA=(--experts 160); CTX=1024; fi
left() { echo $(( ${BUDGET:-470} - ($(date +%s) - T0) )); }
VARIANTS=("default:" "attn_early:--attn-mixes early" "ffn_late:--ffn-mixes late --shared-expert side"
          "both:--attn-mixes early --ffn-mixes late --shared-expert side")
for r in $(seq 1 "${ROUNDS:-2}"); do
    for spec in "${VARIANTS[@]}"; do
        v=${spec%%:*}
        read -r -a ARGS <<< "${spec#*:}"
        l=$(left); [ "$l" -lt 50 ] && { echo "skip $v r$r" >> "$ROOT/summary.txt"; continue; }
        t=$(date +%s)
        timeout $(( l < 200 ? l : 200 )) python3 bench/bench_v41_decode.py --contexts $CTX --rounds 3 --trace-steps 0 \
            --graph-only "${ARGS[@]}" "${EXTRA[@]}" --out "$ROOT/decode_${v}_r$r.jsonl" > "$ROOT/decode_${v}_r$r.log" 2>&1
        echo "rc=$? $v r$r $(( $(date +%s) - t ))s" >> "$ROOT/summary.txt"
    done
done
l=$(left)
if [ "$l" -gt 40 ]; then
    DS4_REQUIRE_CUDA=1 timeout "$l" python3 -m pytest -q tests/engine/test_engine_cuda.py -k "placement" \
        > "$ROOT/pytest.log" 2>&1
    echo "rc=$? pytest $(tail -1 "$ROOT/pytest.log")" >> "$ROOT/summary.txt"
fi
for f in "$ROOT"/decode_*.jsonl; do
    python3 -c "import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    g = r.get('graph') if r.get('kind') == 'context' else None
    if g:
        print(sys.argv[1].rsplit('/', 1)[-1], r['context'], g['ms_per_token'], g['tokens_per_s'], g['last_token'])" "$f" \
        >> "$ROOT/summary.txt"
done
cd "$ROOT" && tar czf all.tgz --exclude=all.tgz . ; cat summary.txt
