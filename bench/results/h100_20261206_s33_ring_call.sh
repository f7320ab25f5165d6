#!/usr/bin/env bash
# one-off (thirty-third session): the q4_K one-token kernels' weight rings (cp.async; FP8 and integer paths) against
# the register paths: the probe per ring depth, then whole V4.1 decode steps alternating (tree = rings of 2, "reg" =
# both 0), then the GPU tests of the change. EXP="--experts 160" on an H100.
set -u
T0=$(date +%s); LIM=${LIM:-560}; EXP=${EXP:-}; CTX=${CTX:-1024,65536}
pip install -q --no-deps --target /tmp/site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH="$PWD:/tmp/site" DS4_KERNEL_CACHE=/tmp/kcache PYTHONUNBUFFERED=1 NUMBA_CUDA_LOW_OCCUPANCY_WARNINGS=0
unset NUMBA_ENABLE_CUDASIM
mkdir -p "$OUT/r"
left() { echo $((LIM - ($(date +%s) - T0))); }
K() { echo "import kernels.q4k_gemv as q; q.MMA_RING = $1; q.IM_RING = $1; q.q4k_mma_t1_kernel = q._make_mma_kernel(True, q.MMA_MIN_BLOCKS_T1, ring=$1); q.q4k_imma_t1_kernel = q._make_im_kernel(True, ring=$1); q.q4k_imma_t1s_kernel = q._make_im_kernel(True, stage=True, ring=$1)"; }
B=(bench/bench_v41_decode.py --rounds 3 --trace-steps 0 --graph-only $EXP)
dec() {  # name ring
    local l; l=$(left); [ "$l" -lt 60 ] && { echo "SKIP $1"; return; }
    timeout "$l" python3 bench/dev/knobs.py --exec "$(K "$2")" -- "${B[@]}" --contexts "$CTX" --out "$OUT/r/$1.jsonl" > "$OUT/r/$1.log" 2>&1
    echo "$1 rc=$? $(grep -o '"ms_per_token": [0-9.]*' "$OUT/r/$1.jsonl" 2>/dev/null | tr '\n' ' ') $(grep -o '"last_token": [0-9]*' "$OUT/r/$1.jsonl" 2>/dev/null | tail -1) t=$(( $(date +%s) - T0 ))s"
    tail -2 "$OUT/r/$1.log" | cut -c1-300
}
one() {  # name cmd...
    local n=$1; shift; local l; l=$(left); [ "$l" -lt 20 ] && { echo "SKIP $n"; return; }
    timeout "$l" "$@" > "$OUT/r/$n.out" 2> "$OUT/r/$n.err"
    echo "$n rc=$? t=$(( $(date +%s) - T0 ))s"; tail -12 "$OUT/r/$n.out" | cut -c1-330; tail -2 "$OUT/r/$n.err" | cut -c1-300
}
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv,noheader
dec tree_r1 2; dec reg_r1 0
one ring_mma python3 bench/dev/q4k_probe.py --time --mode mma --rings 0,2 --shapes wq_b,shared_w1
one ring_imma python3 bench/dev/q4k_probe.py --time --mode imma --rings 0,2 --shapes wo_a,wq_a,head
one ring_imma8 python3 bench/dev/q4k_probe.py --time --mode imma8 --rings 0,2 --shapes wo_b
dec reg_r2 0; dec tree_r2 2
one gpu_tests env DS4_REQUIRE_CUDA=1 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_cp_async.py tests/kernels/test_q4k_gemv.py -k "cp_async or 16_bytes or imma_prefill or mma_prefill"
dec tree_r3 2; dec reg_r3 0
tar czf "$OUT/call4.tgz" -C "$OUT" r
