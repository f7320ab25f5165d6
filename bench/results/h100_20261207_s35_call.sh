#!/usr/bin/env bash
# Thirty-fifth session, device call: the VQ GEMV with more blocks in flight (probe and whole steps), the dp4a and VQ
# kernel tests on a GPU. One-off, run as ab_run/s35_call1.sh (this is its copy).
set -u
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
START=$(date +%s)
pip install -q --no-deps --target /tmp/site .whl/*.whl > "$OUT/setup.log" 2>&1
export PYTHONPATH="$PWD:/tmp/site" DS4_KERNEL_CACHE=/tmp/kcache PYTHONUNBUFFERED=1 PYTEST_DISABLE_PLUGIN_AUTOLOAD=1
export NUMBA_CUDA_LOW_OCCUPANCY_WARNINGS=0
unset NUMBA_ENABLE_CUDASIM
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv > "$OUT/env.txt" 2>&1
EXP=${EXP:---experts 160}
t() { echo "[$(( $(date +%s) - START ))s] $*" | tee -a "$OUT/summary.txt"; }
pack() { tar czf /tmp/all.tgz -C "$OUT" . && mv /tmp/all.tgz "$OUT/all.tgz"; }
for p in 2 4 3 2 4; do
    t "vq_probe prefetch $p"
    timeout 60 python3 bench/dev/vq_probe.py --bits 13 --prefetch $p >> "$OUT/vq_probe.jsonl" 2>> "$OUT/vq_probe.err"
    t "rc=$?"
done
pack
t tests
DS4_REQUIRE_CUDA=1 timeout 110 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_q4k_dp4a.py \
    tests/kernels/test_vq_gemv.py -k "not sm90" > "$OUT/tests.log" 2>&1; t "rc=$?"
pack
DEC=(bench/bench_v41_decode.py --contexts 1024 --rounds 3 --trace-steps 0 --graph-only $EXP)
P4="import kernels.vq_gemv as v; v.vq_gemv_kernel = v._make_vq_kernel(v.THREADS, False, 1, ${PF:-4})"
for i in 1 2 3; do
    t "decode p2 $i"
    timeout 150 python3 "${DEC[@]}" --out "$OUT/decode_p2_$i.jsonl" >> "$OUT/decode.log" 2>&1; t "rc=$?"
    t "decode p${PF:-4} $i"
    timeout 150 python3 bench/dev/knobs.py --exec "$P4" -- "${DEC[@]}" --out "$OUT/decode_pf_$i.jsonl" \
        >> "$OUT/decode.log" 2>&1; t "rc=$?"
    pack
done
t done
