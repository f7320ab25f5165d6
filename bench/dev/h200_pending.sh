#!/usr/bin/env bash
# The checks and A/B timings that wait for the lent H200, in one device call of about 9.5 minutes. Everything is
# written under $OUT. Each part has a time cap and may fail; summary.txt gives every part's status and seconds.
#
#   bash bench/dev/h200_pending.sh            # on the device, from the repository root
#
# The V4.1 decode parts (decode, base, before, flags, trace) hold 110 GB of synthetic weights: they need the H200
# (pass needs_h200 to the run); on an H100 (78 GiB) they stop at once on CUDA_ERROR_OUT_OF_MEMORY unless
# DS4_BENCH_ARGS="--experts 160" shrinks each layer's resident experts (the same bytes a step: an A/B there, not a
# figure of record).
#
# What to send with the call (bench/dev/h200_stage.sh prepares all of it, and undoes it afterwards with --undo):
# - carry [".whl"]. Build it first with `pip download --no-deps -d .whl gguf llguidance` (the device has no index).
# - AB_BEFORE (default ab/): a folder of "before" files. Each sits at its path relative to the repository root.
#   Take a whole package, because the modules import one another: `mkdir -p ab && git archive 9e36682 kernels |
#   tar -x -C ab` gives the kernels before the twentieth session's changes. The folder must be untracked and not
#   ignored, so that it travels with the tree. The "before" parts copy those files in and restore the tree's own
#   afterwards. Files that exist only in the tree (kernels/fp8.py) stay but go unused. Without the folder, the
#   "before" parts are skipped.
# - The tree must stay under 64 MiB. Untrack models/ and tests/golden/official_v41_tiny for the call; the engine
#   tests then run on the random tiny stack.
#
# - AB_HEAD (default ab_head/): a second folder of files, BASE's copies of the kernel files the tree changed since
#   BASE (h200_stage.sh's second argument, default HEAD): the "base" part times the tree with them.
#
# Everything the parts write is also packed into $OUT/all.tgz at the end (a device call returns at most 8 files).
#
# The parts, in the order they run (the order of priority):
#   tests     DS4_REQUIRE_CUDA=1 pytest tests/kernels (the CPU-only modules left out). The twenty-first session's
#             call ran the first 142 of 190 tests, all passing, before its cap: test_vq_gemv, test_vq_assign,
#             test_step, test_window_snapshot and the last of test_spec_accept have not run on the H200 since the
#             twentieth session's kernel changes; test_mma (the E4M3 MMA as two chained f16 MMAs against the
#             instruction) and the q4_K tests of the twenty-first session's kernel changes never have. Stage with
#             `h200_stage.sh a201213`: ab/ then holds the kernels this session timed.
#   decode    bench/bench_v41_decode.py --contexts 1024,65536 --rounds 3, this tree as it is (eager and graph)
#   base      the same, graph replay only (--graph-only), with ab_head/'s files: the newest kernel change's A/B
#   before    the same, graph only, on the "before" files of ab/
#   flags     the same, graph only, with kernels.indexer.SCORES_MMA and TOPK_ONE switched on (no file is edited);
#             DS4_FLAGS=scores,topk,both times each alone and both (files decode_flags_scores / _topk / decode_flags)
#   unfused   the same, graph only, through bench/dev/unfused.py --split attn: the queries' RoPE and the window write
#             as launches of their own again (the twenty-fourth session's fusions, untimed there)
#   unfused_vq  the same, --split vq: the MoE's gate / up input staged by its own launch again, not by the ffn norm
#             (a twenty-fifth session's fusion, untimed there)
#   unfused_wo_a  the same, --split wo_a: wo_a's integer-path input staged by its own launch again, not by the
#             attention's combine kernel (the other twenty-fifth session's fusion, untimed there)
#   unfused_q_norm  the same, --split q_norm: the q latent's norm as its own rms_norm launch again, not in wq_b's
#             staging (the twenty-sixth session's fusion)
#   unfused_combine  the same, --split combine: the MoE's combine as its own launch again, not in the ffn's hc_post
#             (the same session's)
#   unfused_wo_b  the same, --split wo_b: wo_b's integer-path input staged by its own launch again, not by wo_a's
#             kernel (the same session's)
#   unfused_route  the same, --split route: the router's top-k as its own launch again, not in the gate GEMV's last
#             block (the twenty-seventh session's)
#   unfused_norm  the same, --split norm: the decode step's norms in one block a row again (the same session's)
#   unfused_sh_stage  the same, --split sh_stage: the shared expert's gate / up input staged by its own launch on
#             the side stream again, not by the ffn norm (the thirty-first session's)
#   unfused_xq_stage  the same, --split xq_stage: wq_a's and wkv's input staged by their own launches again, not by
#             the attention norm (the thirty-eighth session's)
#   unfused_q_stage  the same, --split q_stage: the q latent staged for wq_b by its own launch again, not by the q
#             latent's norm (the same session's)
#   unfused_w2_stage  the same, --split w2_stage: the shared expert's w2 input staged by its own launch again, not by
#             its SwiGLU (the same session's)
#   unfused_stage38  the same, --split xq_stage,q_stage,w2_stage: the three together (not in the default list)
#   unfused_rope_q  the same, --split rope_q: the window key's norm + RoPE in one block a row again (the same
#             session's; not in the default list)
#   priority  the same, graph only, with DS4_CUDA_PRIORITY=1: the main stream at the highest priority, the side
#             stream at the lowest, captured into the graph's nodes (the twenty-ninth session's; not in the default
#             list: name it, e.g. DS4_PARTS=decode,priority DS4_ROUNDS=3)
#   prefetch  the same, graph only, with --l2-prefetch for each of DS4_PREFETCH's space-separated sets (default "wo
#             wq wo,wq"): weights asked of L2 ahead of their GEMVs (the thirtieth session's kernels.prefetch; not in
#             the default list: e.g. DS4_PARTS=decode,prefetch DS4_ROUNDS=2)
#   vq        bench/dev/vq_probe.py at 13 and 12 bits, and bench/dev/q4k_probe.py --time on the FP8 (mma) and FP32
#             (imma: head, wo_a) paths, this tree, then the "before" files (same lease); q4k_probe --check --save of
#             both trees, and whether their tensor-core outputs are equal (the twenty-first session's q4_K changes
#             are meant to keep the bits)
#   lut       bench/dev/vq_lut.py (the lookup-table form of the decode gate / up GEMV, a probe) at 13 and 12 bits, and
#             bench/dev/vq_probe.py at 13 bits in the same lease (the thirty-second session's; not in the default
#             list: DS4_PARTS=lut, about 30 s on a warm machine)
#   fp8im     the FP8 path's q4_K GEMVs (wq_a, wq_b, the shared expert's w2): bench/dev/q4k_probe.py --time on
#             those shapes, --mode mma and --mode imma8 (the integer path's one-token dp4a kernel, the default since
#             the thirty-seventh session), then per round a graph-only decode through bench/dev/knobs.py with the
#             thresholds that kept them on q4k_mma before (IM_FP8_MIN_ROWS = 4,096, IM_FP8_MIN_SB = 16: wq_b, wq_a,
#             wkv and the shared w2 back on q4k_mma; their bits change; not in the default list)
#   trace     the per-op table at 1k with DS4_CUDA_PDL=0 (--trace-steps 2; each kernel's events also in
#             timeline_pdl0.jsonl, ~2,400 lines, and their critical path in critical_path.txt,
#             bench/dev/critical_path.py): with programmatic edges a kernel's traced
#             time includes its wait for the one before, so only this table gives each kernel's own time
#   engine    DS4_REQUIRE_CUDA=1 pytest on the CUDA engine tests (graph == eager, byte identity, speculative; about
#             150 s gave 7 of them on a fresh machine: give it a call of its own)
#   index     bench/dev/index_probe.py (the score kernels' times and bits at 256 / 4,096 / 16,384 rows)
#   route     bench/dev/route_probe.py: the router's one-token call in its forms at 160 and 384 experts, then its
#             top-k alone at top-k 1 and 6 (the difference / 5: a round's cost); about 40 s on a warm machine (the
#             thirty-ninth session's; not in the default list)
#   attn      bench/dev/attn_probe.py: the sparse attention of one decode token at 128 and 640 rows, whole and kernel by
#             kernel (the score kernel with and without the query's RoPE, the launcher's rows a quad and 1), on the
#             tree (attn.jsonl) and with ab_head/'s files (attn_base.jsonl), two rounds alternating (the fortieth
#             session's; not in the default list)
#   hc        bench/dev/hc_probe.py: the mHC mixes (cold weights), hc_post of the MoE's terms and hc_post of one
#             decode token, on the tree (hc.jsonl) and with ab_head/'s files (hc_base.jsonl), two rounds alternating
#             (the forty-second session's; not in the default list)
# DS4_PARTS=tests,vq limits the run to those parts; DS4_TEST_FILES / DS4_TESTS_CAP pick the test part's files and cap,
# DS4_GRAPH_ONLY=1 drops the decode part's eager runs; DS4_CONTEXTS (default 1024,65536) sets every decode run's
# contexts; DS4_ROUNDS=N runs the decode variants (decode, base, before, flags, unfused*: those asked for) N times
# in turn, files of rounds after the first named *_rN (one lease's drift is as large as most single changes: compare
# alternating runs); summary.txt ends with every decode run's graph figures in the order they ran;
# DS4_BEFORE_CAP / DS4_TRACE_CAP / DS4_ENGINE_CAP change those
# parts' caps (a warm machine needed 125 s for "before", 123 s for "trace" and about 300 s for all 41 engine tests).
# The caps add up to more than one call's 560 s, and a fresh machine compiles every kernel first (~130 s; a
# swapped-in file recompiles its module), so a first call stops around "flags": run the rest as later calls, e.g.
# DS4_PARTS=engine, then DS4_PARTS=vq,trace,index (the kernel cache in /tmp survives while the machine stays warm,
# not on a new one).
set -u
START=$(date +%s)
BUDGET=${DS4_RUN_BUDGET_S:-560}
END=$((START + BUDGET))
OUT=${OUT:-$PWD/out}
AB=${AB_BEFORE:-ab}
AB_HEAD=${AB_HEAD:-ab_head}
mkdir -p "$OUT"
SUMMARY="$OUT/summary.txt"
: > "$SUMMARY"
UNFUSED=unfused,unfused_vq,unfused_wo_a,unfused_q_norm,unfused_combine,unfused_wo_b,unfused_route,unfused_norm,\
unfused_sh_stage,unfused_xq_stage,unfused_q_stage,unfused_w2_stage
PARTS=${DS4_PARTS:-tests,decode,base,before,flags,$UNFUSED,vq,trace,engine,index}
ROUNDS=${DS4_ROUNDS:-1}
DS4_FLAGS=${DS4_FLAGS:-both}

if [ -d .whl ]; then
    pip install -q --no-deps --target /tmp/site .whl/*.whl >> "$OUT/setup.log" 2>&1
fi
export PYTHONPATH="$PWD:/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
export DS4_KERNEL_CACHE=${DS4_KERNEL_CACHE:-/tmp/kcache}
export PYTHONUNBUFFERED=1 PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 NUMBA_CUDA_LOW_OCCUPANCY_WARNINGS=0
unset NUMBA_ENABLE_CUDASIM
PY=${PYTHON:-python3}
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv > "$OUT/env.txt" 2>&1

note() { echo "$*" | tee -a "$SUMMARY"; }
want() { case ",$PARTS," in *",$1,"*) return 0 ;; *) return 1 ;; esac; }

# run NAME CAP LOG CMD...: time-boxed by CAP seconds or by what is left of the budget
run() {
    local name=$1 cap=$2 log=$3; shift 3
    local left=$((END - $(date +%s) - 5))
    [ "$left" -lt "$cap" ] && cap=$left
    if [ "$cap" -lt 20 ]; then note "SKIP  $name (${left}s left)"; return 0; fi
    local t0; t0=$(date +%s)
    echo "=== $name: $*" >> "$OUT/$log"
    timeout -k 10 "$cap" "$@" >> "$OUT/$log" 2>&1
    local rc=$? dt=$(( $(date +%s) - t0 ))
    if [ "$rc" -eq 0 ]; then note "OK    $name ${dt}s"
    elif [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then note "TIME  $name ${dt}s (cap ${cap}s)"
    else note "FAIL  $name ${dt}s rc=$rc"; fi
}

# swap_in [DIR] / swap_out: the "before" files (of $AB, or DIR) over the tree's, and back. Copies keep their mtimes
# (cp -p): numba's cache entry of a kernel holds its file's mtime and size, so a restored tree file with a new mtime
# recompiled its module in every run after a swap (110 s a run on the H100, the twenty-seventh session), while with
# the old mtime the tree's cache directory (kernels/__init__.py: one a source version) still serves it
BACKUP=/tmp/ab_backup
swap_in() {
    local dir=${1:-$AB}
    rm -rf "$BACKUP"; mkdir -p "$BACKUP"
    (cd "$dir" && find . -type f) | while read -r f; do
        mkdir -p "$BACKUP/$(dirname "$f")"; cp -p "$f" "$BACKUP/$f"; cp -p "$dir/$f" "$f"; done
}
swap_out() { (cd "$BACKUP" && find . -type f) | while read -r f; do cp -p "$BACKUP/$f" "$f"; done; }
have_ab() { local dir=${1:-$AB}; [ -d "$dir" ] && [ -n "$(find "$dir" -type f | head -1)" ]; }

# DS4_BENCH_ARGS: more arguments of every decode run, e.g. "--experts 160" (an H100's A/B: bench_v41_decode.py)
read -r -a BENCH_ARGS <<< "${DS4_BENCH_ARGS:-}"
CONTEXTS=${DS4_CONTEXTS:-1024,65536}   # the decode runs' contexts
DECODE=(bench/bench_v41_decode.py --contexts "$CONTEXTS" --rounds 3 --trace-steps 0 "${BENCH_ARGS[@]}")
[ "${DS4_GRAPH_ONLY:-0}" = 1 ] && DECODE+=(--graph-only)   # the tree's decode without its eager runs (~60 s less)
AB_DECODE=(bench/bench_v41_decode.py --contexts "$CONTEXTS" --rounds 3 --trace-steps 0 --graph-only
           "${BENCH_ARGS[@]}")   # variants
# the indexer's flags on (DS4_FLAGS: "both", the default, and / or "scores" or "topk" alone, comma-separated)
flags_on() {
    echo "import runpy, sys, kernels.indexer as i; i.SCORES_MMA = $1; i.TOPK_ONE = $2; \
sys.argv = ['bench/bench_v41_decode.py'] + sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')"
}

if want tests; then
    # DS4_TEST_FILES runs those files alone, in that order, instead of all of tests/kernels (pytest merges a file
    # named beside its folder back into the folder's order); DS4_TESTS_CAP changes the part's cap
    run tests "${DS4_TESTS_CAP:-180}" pytest.log env DS4_REQUIRE_CUDA=1 $PY -m pytest -q \
        ${DS4_TEST_FILES:-tests/kernels} \
        --ignore=tests/kernels/test_compile_sm90.py --ignore=tests/kernels/test_kernel_cache.py \
        --ignore=tests/kernels/test_cudasim_shim.py   # CPU-only checks
fi
probes() {   # probes SUFFIX LABEL: the kernel probes, their JSON lines into vq$SUFFIX.jsonl and q4k$SUFFIX.jsonl
    for b in 13 12; do run "vq_probe bits=$b$2" 60 "vq$1.jsonl" $PY bench/dev/vq_probe.py --bits $b; done
    run "q4k_probe mma$2" 60 "q4k$1.jsonl" $PY bench/dev/q4k_probe.py --time --mode mma
    run "q4k_probe imma$2" 60 "q4k$1.jsonl" $PY bench/dev/q4k_probe.py --time --mode imma --shapes head,wo_a
    for m in mma imma; do      # the tensor-core outputs at V4.1 shapes, kept to compare the two trees' bits
        run "q4k_probe check $m$2" 60 "q4k_check$1.jsonl" $PY bench/dev/q4k_probe.py --check --mode $m \
            --save "$OUT/bits$1"
    done
}
if want fp8im; then
    for m in mma imma8; do
        run "q4k_probe $m, the FP8 path's shapes" 60 fp8im.jsonl $PY bench/dev/q4k_probe.py --time --mode $m \
            --shapes wq_a,wq_b,shared_w2
    done
fi
for R in $(seq 1 "$ROUNDS"); do     # DS4_ROUNDS: the decode variants in turn, again and again (one lease drifts)
S=$([ "$R" = 1 ] && echo "" || echo "_r$R")
if want decode; then
    if [ "$R" = 1 ]; then
        run decode 200 decode.log $PY "${DECODE[@]}" --out "$OUT/decode.jsonl"
    else
        run "decode$S" 110 decode.log $PY "${AB_DECODE[@]}" --out "$OUT/decode$S.jsonl"
    fi
fi
if want base && have_ab "$AB_HEAD"; then
    swap_in "$AB_HEAD"
    run "decode (base)$S" 110 base.log $PY "${AB_DECODE[@]}" --out "$OUT/decode_base$S.jsonl"
    swap_out
fi
if want before && have_ab; then
    swap_in
    run "decode (before)$S" "${DS4_BEFORE_CAP:-110}" before.log $PY "${AB_DECODE[@]}" \
        --out "$OUT/decode_before$S.jsonl"
    swap_out
fi
if want flags; then
    for flag in ${DS4_FLAGS//,/ }; do
        case $flag in
            both) code=$(flags_on True True); name=decode_flags ;;
            scores) code=$(flags_on True False); name=decode_flags_scores ;;
            topk) code=$(flags_on False True); name=decode_flags_topk ;;
            *) note "FAIL  DS4_FLAGS: unknown flag $flag (both, scores, topk)"; continue ;;
        esac
        run "decode, indexer flags $flag on$S" 90 flags.log $PY -c "$code" "${AB_DECODE[@]:1}" \
            --out "$OUT/$name$S.jsonl"
    done
fi
for spec in "unfused attn attention launches" "unfused_vq vq VQ staging" "unfused_wo_a wo_a wo_a staging" \
        "unfused_q_norm q_norm q_norm" "unfused_combine combine MoE combine" "unfused_wo_b wo_b wo_b staging" \
        "unfused_route route router top-k" "unfused_norm norm one-block norms" \
        "unfused_sh_stage sh_stage shared expert staging" "unfused_xq_stage xq_stage wq_a / wkv staging" \
        "unfused_q_stage q_stage wq_b staging" "unfused_w2_stage w2_stage shared w2 staging" \
        "unfused_stage38 xq_stage,q_stage,w2_stage all three of those stagings" \
        "unfused_rope_q rope_q one-block window key norms"; do
    read -r part split label <<< "$spec"              # the part, bench/dev/unfused.py's split, the summary's words
    if want "$part"; then
        run "decode, $label unfused$S" 110 "$part.log" $PY bench/dev/unfused.py --split "$split" \
            "${AB_DECODE[@]:1}" --out "$OUT/decode_$part$S.jsonl"
    fi
done
if want fp8im; then
    run "decode, the FP8 path on q4k_mma$S" 110 fp8im.log $PY bench/dev/knobs.py --exec \
        "import kernels.q4k_gemv as q; q.IM_FP8_MIN_ROWS = 4096; q.IM_FP8_MIN_SB = 16" -- "${AB_DECODE[@]}" \
        --out "$OUT/decode_fp8mma$S.jsonl"
fi
if want priority; then
    run "decode, stream priorities on$S" 110 priority.log env DS4_CUDA_PRIORITY=1 $PY "${AB_DECODE[@]}" \
        --out "$OUT/decode_priority$S.jsonl"
fi
if want prefetch; then
    for set in ${DS4_PREFETCH:-wo wq wo,wq}; do
        run "decode, L2 prefetch $set$S" 110 prefetch.log $PY "${AB_DECODE[@]}" --l2-prefetch "$set" \
            --out "$OUT/decode_prefetch_${set//,/_}$S.jsonl"
    done
fi
done
if want vq; then
    probes "" ""
    if have_ab; then
        swap_in
        probes "_before" " (before)"
        swap_out
        run "q4k bits: tree == before" 20 q4k_check.jsonl $PY -c "import glob, os, sys, numpy as np
fs = sorted(glob.glob(sys.argv[1] + '/*.npy'))
bad = [os.path.basename(f) for f in fs
       if not np.array_equal(np.load(f), np.load(os.path.join(sys.argv[2], os.path.basename(f))))]
print({'compared': len(fs), 'differ': bad}); sys.exit(1 if bad or not fs else 0)" "$OUT/bits" "$OUT/bits_before"
    fi
fi
if want lut; then
    run "lookup-table probe, 13-bit" 60 lut.jsonl $PY bench/dev/vq_lut.py --bits 13
    run "lookup-table probe, 12-bit" 60 lut.jsonl $PY bench/dev/vq_lut.py --bits 12
    run "vq_probe, 13-bit (the same lease)" 60 lut.jsonl $PY bench/dev/vq_probe.py --bits 13
fi
if want trace; then
    run "trace (DS4_CUDA_PDL=0)" "${DS4_TRACE_CAP:-90}" trace.log env DS4_CUDA_PDL=0 $PY bench/bench_v41_decode.py \
        --contexts 1024 --rounds 1 --trace-steps 2 "${BENCH_ARGS[@]}" --out "$OUT/trace_pdl0.jsonl" \
        --timeline-out "$OUT/timeline_pdl0.jsonl"
    [ -s "$OUT/timeline_pdl0.jsonl" ] && run "critical path of the trace" 30 critical_path.txt \
        $PY bench/dev/critical_path.py "$OUT/timeline_pdl0.jsonl" --steps 2
fi
if want engine; then
    run engine "${DS4_ENGINE_CAP:-150}" pytest_engine.log env DS4_REQUIRE_CUDA=1 $PY -m pytest -q -x \
        tests/engine/test_engine_cuda.py tests/engine/test_cuda_session_state.py tests/engine/test_speculative_cuda.py
fi
if want index; then
    run index_probe 60 index.jsonl $PY bench/dev/index_probe.py
fi
if want route; then
    run "route_probe" 60 route.jsonl $PY bench/dev/route_probe.py --forms fused,split,gemv,topk,empty
    for k in 1 6; do
        run "route_probe top-k $k" 60 route.jsonl $PY bench/dev/route_probe.py --forms topk,empty --top-k $k
    done
fi
if want attn; then                 # the tree's attention and, with ab_head/'s files, its base's, alternating
    for R in 1 2; do
        run "attn_probe, round $R" 90 attn.jsonl $PY bench/dev/attn_probe.py --rpq 0,1
        if have_ab "$AB_HEAD"; then
            swap_in "$AB_HEAD"
            run "attn_probe (base), round $R" 90 attn_base.jsonl $PY bench/dev/attn_probe.py --rpq 0,1
            swap_out
        fi
    done
fi
if want hc; then                   # the tree's mHC kernels and, with ab_head/'s files, its base's, alternating
    for R in 1 2; do
        run "hc_probe, round $R" 60 hc.jsonl $PY bench/dev/hc_probe.py
        if have_ab "$AB_HEAD"; then
            swap_in "$AB_HEAD"
            run "hc_probe (base), round $R" 60 hc_base.jsonl $PY bench/dev/hc_probe.py
            swap_out
        fi
    done
fi
# the graph replay of every decode run, in the order they ran: variant, context, ms a token, nodes, last token
ls -tr "$OUT"/decode*.jsonl 2>/dev/null | while read -r f; do
    $PY -c "import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    g = r.get('graph') if r.get('kind') == 'context' else None
    if g:
        print(f\"{sys.argv[1].rsplit('/', 1)[-1]:30s} {r['context']:>6} {g['ms_per_token']:>7} ms \"
              f\"{g['tokens_per_s']:>7} tok/s {g.get('graph_nodes')} nodes, last {g.get('last_token')}\")" "$f" \
        | tee -a "$SUMMARY"
done
note "total $(( $(date +%s) - START ))s"
# a device call returns at most 8 files from $OUT: everything above, in one archive
tar czf "$OUT/all.tgz" -C "$OUT" --exclude=all.tgz . 2>/dev/null
