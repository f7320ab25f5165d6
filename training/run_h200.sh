#!/usr/bin/env bash
# One call of the ds4-tiny training run on the lent H200 (each call under 10 minutes; chain calls to go on).
#   carry .train_data (the xz-compressed training parts from `ds4 corpus train-set`)
#   TOKENS: the whole run's token target; TOTAL: seconds of training the whole run may take (the first call
#   fits the step count to it); BUDGET: seconds of training in this call.
# The resumable state lives in .train_state on the GPU machine (about 0.9 GB: weights and AdamW moments); it
# survives between calls while the machine is held, because .gitignore names it (the device keeps ignored
# paths; on 2026-12-01 a state folder ignored only through .git/info/exclude was gone at the next call). Each unfinished call also sends back the weights so far
# ($OUT/snapshot, official format); the finished run sends back $OUT/run/ckpt and its log.
set -euo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, numpy, tokenizers; print('torch', torch.__version__, 'numpy', numpy.__version__, 'tokenizers', tokenizers.__version__)"
mkdir -p "$OUT/run" .train_state
python3 -m training.train --data "${DATA:-.train_data}" --config training/ds4_tiny_config.json \
    --tokenizer data/tokenizer/tokenizer.json --slices data/slices --out "$OUT/run" --state .train_state \
    --tokens "${TOKENS:-200e6}" --total-budget "${TOTAL:-0}" --budget "${BUDGET:-480}" \
    --snapshot "$OUT/snapshot" ${TRAIN_ARGS:-} 2>&1 | tee "$OUT/train_stdout.txt"
ls -la .train_state "$OUT"/*
