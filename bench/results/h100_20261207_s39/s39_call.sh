#!/usr/bin/env bash
# session 39 device call: $1 = list of steps
set -u
ROOT=$OUT
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "$GPU" > $ROOT/gpu.txt
if echo "$GPU" | grep -q H200; then EXP=""; CTX=${CTX:-1024,65536}; else EXP="--experts 160"; CTX=1024; fi
export PYTHONPATH=$PWD:/tmp/site DS4_KERNEL_CACHE=/tmp/kcache PYTHONUNBUFFERED=1 PYTEST_DISABLE_PLUGIN_AUTOLOAD=1
export NUMBA_CUDA_LOW_OCCUPANCY_WARNINGS=0
pip install -q --no-deps --target /tmp/site .whl/*.whl > /dev/null 2>&1
for step in $1; do
  t0=$(date +%s)
  case $step in
    tests) OUT=$ROOT/tests DS4_PARTS=tests DS4_TEST_FILES="${TFILES:-tests/kernels/test_rms_norm.py}" \
           DS4_TESTS_CAP=${TCAP:-200} DS4_RUN_BUDGET_S=${TCAP:-200} bash bench/dev/h200_pending.sh ;;
    route) timeout 120 python3 bench/dev/route_probe.py > $ROOT/route.jsonl 2> $ROOT/route.err ;;
    dec) OUT=$ROOT/dec DS4_PARTS=decode${VAR:-,unfused_rope_q} DS4_GRAPH_ONLY=1 DS4_ROUNDS=${ROUNDS:-2} \
         DS4_CONTEXTS=$CTX DS4_BENCH_ARGS="$EXP" DS4_RUN_BUDGET_S=${DCAP:-300} bash bench/dev/h200_pending.sh ;;
    slopes) for k in 1 2 6; do timeout 90 python3 bench/dev/route_probe.py --forms topk,empty --top-k $k \
           --experts 32,160,384,512 >> $ROOT/slopes.jsonl 2>> $ROOT/slopes.err; done ;;
    ncu) timeout 150 ncu --clock-control none --set full --import-source no -k regex:route_topk --launch-skip 1 \
           --launch-count 1 -f -o /tmp/rt python3 bench/dev/route_probe.py --experts 384 --calls 2 --eager \
           --forms topk > $ROOT/ncu.log 2>&1
         ncu -i /tmp/rt.ncu-rep --page source --csv --print-source sass > $ROOT/ncu_sass.csv 2>> $ROOT/ncu.log
         ncu -i /tmp/rt.ncu-rep --page details >> $ROOT/ncu.log 2>&1 ;;
    slopes2) for k in 1 6; do timeout 60 python3 bench/dev/route_probe.py --forms topk,empty --top-k $k \
           --experts 160,384 >> $ROOT/slopes2.jsonl 2>> $ROOT/slopes.err; done ;;
    routeab) for r in 1 2; do
           timeout 90 python3 bench/dev/route_probe.py --forms fused,topk,empty >> $ROOT/routeab_tree.jsonl 2>> $ROOT/routeab.err
           cp -p kernels/moe.py /tmp/moe_tree.py; cp -p ab_head/kernels/moe.py kernels/moe.py
           timeout 90 python3 bench/dev/route_probe.py --forms fused,topk,empty >> $ROOT/routeab_head.jsonl 2>> $ROOT/routeab.err
           cp -p /tmp/moe_tree.py kernels/moe.py; done ;;
    side) for se in side early; do timeout 150 python3 bench/bench_v41_decode.py --contexts 1024 --rounds 3 \
           --trace-steps 0 --graph-only $EXP --shared-expert $se --out $ROOT/se_$se.jsonl >> $ROOT/side.log 2>&1; done ;;
    engine) OUT=$ROOT/engine DS4_PARTS=engine DS4_RUN_BUDGET_S=${ECAP:-400} bash bench/dev/h200_pending.sh ;;
    trace) OUT=$ROOT/trace DS4_PARTS=trace DS4_CONTEXTS=1024 DS4_BENCH_ARGS="$EXP" DS4_RUN_BUDGET_S=200 \
           bash bench/dev/h200_pending.sh ;;
  esac
  echo "$step $(( $(date +%s) - t0 ))s" >> $ROOT/steps.txt
done
cd $ROOT && tar czf /tmp/all.tgz --exclude='*.tgz' . && mv /tmp/all.tgz $ROOT/all.tgz
