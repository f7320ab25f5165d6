#!/usr/bin/env bash
# One command for the lent H200 (nvidia-h200): GPU tests, benchmarks, a generation and the CUDA-vs-CPU agreement,
# everything written under $OUT, within ~9 minutes, each part time-boxed and allowed to fail (the summary says).
#
#   bash bench/run_h200.sh                  # from the repository root on the device; carry .whl (the gguf wheel)
#                                           # and, if it fits, cache/ds4-tiny-base.gguf (else it is rebuilt here
#                                           # with --cuda and its sha256 printed: compare with the CPU-built file)
#   DS4_PARTS=lloyd,lloyd_cpu,kernels bash bench/run_h200.sh    # a subset (default: every part, in order)
#
# Files under $OUT (8 at most come back): summary.txt (status and seconds of every part), env.txt, pytest.log,
# bench_engine.jsonl, bench_kernels.jsonl, bench_lloyd.jsonl, generate.txt, stderr.log.
# Parts: pytest, engine, generate, lloyd, lloyd_cpu, kernels. DS4_PYTEST_PATHS and DS4_ENGINE_SECTIONS narrow the
# first two.
# Order = priority: the base file (if missing), pytest, bench_engine (copy/VQ/q4_K GB/s, ds4-tiny prefill and decode,
# CUDA-vs-CPU agreement on the judging slices), the generation, bench_kernels, bench_lloyd.
set -u
START=$(date +%s)
BUDGET=${DS4_RUN_BUDGET_S:-530}
END=$((START + BUDGET))
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
SUMMARY="$OUT/summary.txt"
ERR="$OUT/stderr.log"
: > "$SUMMARY"
: > "$ERR"
export PYTHONUNBUFFERED=1 PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 NUMBA_CUDA_LOW_OCCUPANCY_WARNINGS=0
unset NUMBA_ENABLE_CUDASIM
PY=${PYTHON:-python3}
BASE=cache/ds4-tiny-base.gguf
CKPT=models/ds4-tiny

PARTS=${DS4_PARTS:-pytest,engine,generate,lloyd,lloyd_cpu,kernels}
note() { echo "$*" | tee -a "$SUMMARY"; }
want() { case ",$PARTS," in *",$1,"*) return 0 ;; *) return 1 ;; esac; }

# run NAME CAP_SECONDS OUTFILE CMD...: time-boxed (the cap, or what is left of the budget), stdout to OUTFILE.
run() {
    local name=$1 cap=$2 outfile=$3; shift 3
    local now left t0 rc
    now=$(date +%s); left=$((END - now - 5))
    if [ "$left" -lt "$cap" ]; then cap=$left; fi
    if [ "$cap" -lt 20 ]; then note "SKIP  $name (budget spent: ${left}s left)"; return 0; fi
    echo "=== $name (cap ${cap}s): $*" >> "$ERR"
    t0=$(date +%s)
    timeout -k 10 "$cap" "$@" >> "$outfile" 2>> "$ERR"
    rc=$?
    local dt=$(( $(date +%s) - t0 ))
    if [ "$rc" -eq 0 ]; then note "OK    $name ${dt}s"
    elif [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then note "TIME  $name ${dt}s (cap ${cap}s; partial output kept)"
    else note "FAIL  $name ${dt}s rc=$rc"; fi
    return 0
}

{
    date -u; nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv 2>&1
    $PY -c "import sys, numpy, numba; print(sys.version); print('numpy', numpy.__version__, 'numba', numba.__version__)"
    $PY -m pip show numba-cuda cuda-bindings 2>/dev/null | grep -E '^(Name|Version)'
    git log --oneline -1 2>/dev/null; git status --short 2>/dev/null | head -40
} > "$OUT/env.txt" 2>&1

# the gguf package is not on the image: install the carried wheel(s)
if ls .whl/*.whl >/dev/null 2>&1; then
    if $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
            >> "$ERR" 2>&1; then
        export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
        note "OK    wheels: $(ls .whl/*.whl | xargs -n1 basename | tr '\n' ' ')"
    else
        note "FAIL  wheel install (see stderr.log)"
    fi
else
    note "WARN  no .whl/*.whl carried: 'import gguf' will fail unless the image has it"
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
$PY -c "import gguf, numba.cuda as c; assert c.is_available(); print('gguf', gguf.__file__)" >> "$OUT/env.txt" 2>&1 \
    || note "FAIL  import check (gguf / CUDA), see env.txt"

# ds4-tiny base file: carried, or rebuilt here on the GPU (same bytes as the CPU path)
if [ ! -f "$BASE" ] && { want pytest || want engine || want generate; }; then
    mkdir -p cache
    run quantize-ds4-tiny 200 "$OUT/stderr.log" $PY -m ds4lib.tools.cli quantize --checkpoint "$CKPT" --out "$BASE" \
        --cuda --quiet
fi
[ -f "$BASE" ] && note "INFO  base $BASE $(stat -c %s "$BASE") bytes sha256 $(sha256sum "$BASE" | cut -c1-16)"

# (a) the GPU-relevant tests: every kernel test (skips become failures) and the CUDA engine tests
want pytest && run pytest 240 "$OUT/pytest.log" env DS4_REQUIRE_CUDA=1 $PY -m pytest \
    ${DS4_PYTEST_PATHS:-tests/kernels tests/engine/test_engine_cuda.py} -q -m "not slow" -p no:cacheprovider -ra

# (b) + (d) engine benchmark: copy, VQ and q4_K GB/s on one real-size layer, ds4-tiny prefill/decode, agreement
want engine && run bench_engine 240 "$OUT/bench_engine.jsonl" $PY bench/bench_engine.py --base "$BASE" \
    --engram-dir "$CKPT" --only "${DS4_ENGINE_SECTIONS:-copy,vq,q4k,tiny,agreement,layers,profile}" --reps 100 \
    --windows 3

# (c) one greedy generation through the CLI
want generate && run generate 75 "$OUT/generate.txt" $PY -m ds4lib.tools.cli -m "$BASE" --engram-dir "$CKPT" \
    --cuda -p "What does 'ledger' mean?" --temp 0 --stats

# (e) Lloyd on one real-size layer: the CUDA path, then the CPU path (Numba parallel on this host's cores)
want lloyd && run bench_lloyd 150 "$OUT/bench_lloyd.jsonl" $PY bench/bench_lloyd.py --device cuda
want lloyd_cpu && run bench_lloyd_cpu 200 "$OUT/bench_lloyd.jsonl" $PY bench/bench_lloyd.py --device cpu

# (f) the model-op kernels
want kernels && run bench_kernels 100 "$OUT/bench_kernels.jsonl" $PY bench/bench_kernels.py --reps 100

note "TOTAL $(( $(date +%s) - START ))s of ${BUDGET}s"
grep -E "passed|failed|error" "$OUT/pytest.log" | tail -3 | sed 's/^/pytest: /' >> "$SUMMARY"
exit 0
