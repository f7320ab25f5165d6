#!/usr/bin/env bash
# Thirty-fourth session, device call 1: the dp4a one-token integer kernel against q4k_imma_t1 (probe, GPU tests,
# whole steps at 1k, Nsight Compute). One-off; kept in /work/notes.
set -u
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
START=$(date +%s)
pip install -q --no-deps --target /tmp/site .whl/*.whl > "$OUT/setup.log" 2>&1
export PYTHONPATH="$PWD:/tmp/site" DS4_KERNEL_CACHE=/tmp/kcache PYTHONUNBUFFERED=1 PYTEST_DISABLE_PLUGIN_AUTOLOAD=1
export NUMBA_CUDA_LOW_OCCUPANCY_WARNINGS=0
unset NUMBA_ENABLE_CUDASIM
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv > "$OUT/env.txt" 2>&1
git log --oneline -1 > "$OUT/commit.txt" 2>&1
EXP=${EXP:---experts 160}
t() { echo "[$(( $(date +%s) - START ))s] $*" | tee -a "$OUT/summary.txt"; }
pack() { tar czf /tmp/all.tgz -C "$OUT" . && mv /tmp/all.tgz "$OUT/all.tgz"; }
t probe_imma
timeout 170 python3 bench/dev/q4k_probe.py --time --mode imma --shapes head,wo_a,wq_a,wkv,wo_b \
    --dp 0/1,4/0,4/1,5/1,2,2 > "$OUT/probe_imma.jsonl" 2> "$OUT/probe_imma.err"; t "rc=$?"
t probe_imma8
timeout 60 python3 bench/dev/q4k_probe.py --time --mode imma8 --shapes wo_b,shared_w1 --dp 0/1,4/1,2,2 \
    > "$OUT/probe_imma8.jsonl" 2> "$OUT/probe_imma8.err"; t "rc=$?"
t tests
DS4_REQUIRE_CUDA=1 timeout 100 python3 -m pytest -q tests/kernels/test_q4k_dp4a.py tests/kernels/test_q4k_gemv.py \
    -k "dp4a or imma or stage_out or staged" > "$OUT/tests.log" 2>&1; t "rc=$?"
pack
DEC=(bench/bench_v41_decode.py --contexts 1024 --rounds 3 --trace-steps 0 --graph-only $EXP)
OFF="import kernels.q4k_gemv as q; q.USE_DP4A = False"
for i in 1 2; do
    t "decode dp $i"
    timeout 200 python3 "${DEC[@]}" --out "$OUT/decode_dp_$i.jsonl" >> "$OUT/decode.log" 2>&1; t "rc=$?"
    t "decode imma $i"
    timeout 100 python3 bench/dev/knobs.py --exec "$OFF" -- "${DEC[@]}" --out "$OUT/decode_imma_$i.jsonl" \
        >> "$OUT/decode.log" 2>&1; t "rc=$?"
    pack
done
NCU=(ncu --clock-control none --section SpeedOfLight --section WarpStateStats --section Occupancy
     --section SchedulerStats --launch-skip 2 --launch-count 1)
t ncu_dp
timeout 60 "${NCU[@]}" -k regex:q4k_dp python3 bench/dev/q4k_probe.py --shape wo_b --mode imma \
    > "$OUT/ncu_dp_wo_b.txt" 2>&1; t "rc=$?"
t ncu_imma
timeout 60 "${NCU[@]}" -k regex:q4k_imma python3 bench/dev/q4k_probe.py --shape wo_b --mode imma --dp 0 \
    > "$OUT/ncu_imma_wo_b.txt" 2>&1; t "rc=$?"
pack
t done
