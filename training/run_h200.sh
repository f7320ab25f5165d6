#!/usr/bin/env bash
# The ds4-tiny training run on the lent H200. Each device call lasts under 10 minutes; a run is longer.
#
#   bash training/run_h200.sh [run]    one call of a resumable run: trains BUDGET seconds, saves the state,
#                                      sends back a snapshot ($OUT/snapshot); chain calls to go on
#   bash training/run_h200.sh start    starts the whole run as a background process (its own session, so it
#                                      outlives the call while the machine is held), then watches it
#   bash training/run_h200.sh watch    watches a started run for WATCH seconds or until it ends; sends back its
#                                      log, the latest snapshot and, once finished, the exported checkpoint
#
#   carry .train_data (the xz-compressed training parts from `ds4 corpus train-set`) and, when there is one,
#   .train_cache (the compiler's cache artifacts from an earlier run: most of the cold compilation is skipped)
#   TOKENS: the run's token target; TOTAL: seconds of training the run may take (`run`: the first call fits
#   the step count to it); DEADLINE (`start`): seconds after the start by which the last step must end,
#   compilation included; BUDGET (`run`): seconds of training in this call; WATCH: seconds a call watches.
#
# `run` keeps its resumable state in .train_state (weights and AdamW moments, about 0.9 GB), which survives
# between calls while the machine is held because .gitignore names it (the device keeps ignored paths; a
# folder ignored only through .git/info/exclude was gone at the next call on 2026-12-01). `start` needs no
# resume: one process compiles once and trains to the end (no per-call recompilation or reload), writing a
# snapshot every SNAP_EVERY seconds and its checkpoint into .train_state/run at the end.
set -euo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
export TORCHINDUCTOR_CACHE_DIR=$PWD/.train_state/inductor TRITON_CACHE_DIR=$PWD/.train_state/triton
mode=${1:-run}
mkdir -p "$OUT" .train_state .train_cache
common=(--data "${DATA:-.train_data}" --config training/ds4_tiny_config.json
        --tokenizer data/tokenizer/tokenizer.json --slices data/slices --tokens "${TOKENS:-200e6}")

send_cache() {   # the compiler's cache, for a later run on a fresh machine, when it fits the transfer limit
    if [ -f .train_cache/compile.bin ] && [ "$(stat -c %s .train_cache/compile.bin)" -lt 50000000 ]; then
        cp .train_cache/compile.bin "$OUT/compile.bin"
    fi
}

report() {   # what a call sends back from a started run
    cp .train_state/stdout.txt "$OUT/train_stdout.txt" 2>/dev/null || true
    if [ -f .train_state/run/train_log.json ]; then
        cp -r .train_state/run "$OUT/run"
    elif [ -d .train_state/snapshot ]; then
        cp -r .train_state/snapshot "$OUT/snapshot"
    fi
    [ -f .train_state/run/train_log.json ] && send_cache
    grep -E '^(train:|call|judge|ref vs)' .train_state/stdout.txt | tail -n 12 || true
    tail -n 2 .train_state/stdout.txt || true
}

alive() { pgrep -f -- "-m training.train --data" > /dev/null; }

watch() {    # up to WATCH seconds, or until the run's process is gone
    local until=$((SECONDS + ${WATCH:-540}))
    while [ $SECONDS -lt $until ] && alive; do
        sleep 5
    done
    alive && echo "run: still training" || echo "run: process ended"
    report
}

case "$mode" in
  run)
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
    python3 -c "import torch, numpy, tokenizers; print('torch', torch.__version__, 'numpy', numpy.__version__, 'tokenizers', tokenizers.__version__)"
    mkdir -p "$OUT/run"
    python3 -m training.train "${common[@]}" --out "$OUT/run" --state .train_state \
        --total-budget "${TOTAL:-0}" --budget "${BUDGET:-480}" --snapshot "$OUT/snapshot" \
        --compile-cache .train_cache/compile.bin ${TRAIN_ARGS:-} 2>&1 | tee "$OUT/train_stdout.txt"
    send_cache
    ls -la .train_state "$OUT"/* ;;
  start)
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
    python3 -c "import torch, numpy, tokenizers, triton; print('torch', torch.__version__, 'numpy', numpy.__version__, 'tokenizers', tokenizers.__version__, 'triton', triton.__version__)" || true
    if alive; then
        echo "run: already training"; watch; exit 0
    fi
    rm -rf .train_state/run .train_state/snapshot .train_state/state.pt
    setsid nohup python3 -m training.train "${common[@]}" --out .train_state/run --state .train_state \
        --deadline "${DEADLINE:?seconds from start to the last step}" --budget 100000 --save-every 100000 \
        --snapshot .train_state/snapshot --snapshot-every "${SNAP_EVERY:-240}" \
        --compile-cache .train_cache/compile.bin ${TRAIN_ARGS:-} > .train_state/stdout.txt 2>&1 < /dev/null &
    echo "run: started"; sleep 2
    watch ;;
  watch)
    [ -f .train_state/stdout.txt ] || { echo "run: no started run on this machine (it was given back?)"; exit 2; }
    watch ;;
  *) echo "usage: run_h200.sh [run|start|watch]" >&2; exit 2 ;;
esac
