#!/usr/bin/env bash
# The ds4-tiny training run on the lent H200 (one call of the device tool, under 10 minutes):
#   carry .train_data (the xz-compressed training parts from `ds4 corpus train-set`, see training/README.md)
set -euo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, numpy, tokenizers; print('torch', torch.__version__, 'numpy', numpy.__version__, 'tokenizers', tokenizers.__version__)"
mkdir -p "$OUT/run"
python3 -m training.train --data .train_data --config training/ds4_tiny_config.json \
    --tokenizer data/tokenizer/tokenizer.json --slices data/slices --out "$OUT/run" --budget "${BUDGET:-440}" ${TRAIN_ARGS:-} \
    2>&1 | tee "$OUT/train_stdout.txt"
ls -la "$OUT/run" "$OUT/run/ckpt"
