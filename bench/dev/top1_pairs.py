"""CPU and CUDA logits of the random tiny stack on the judging-window test's four windows, saved for offline study.

tests/engine/test_engine_cuda.py's top-1 test falls back to the random tiny stack when ds4-tiny is not on the
machine (device calls cannot carry it). This writes what that test compares, so its near-tie rule can be read off
the real CPU/GPU differences:

    python bench/dev/top1_pairs.py --out pairs.npz [--backends cpu,cuda]
"""
import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from ds4lib.config import ModelConfig  # noqa: E402
from ds4lib.engine import Engine  # noqa: E402
from ds4lib.quant.base_file import quantize_checkpoint  # noqa: E402
from ds4lib.synth import write_random_checkpoint  # noqa: E402
from tests.engine.test_engine_cuda import random_stack_windows  # noqa: E402

TOKENIZER = ROOT / "data" / "tokenizer" / "tokenizer.json"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--backends", default="cpu,cuda")
    a = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="top1_pairs_"))
    ckpt = write_random_checkpoint(root / "ckpt", ModelConfig.tiny(), seed=0)
    base = root / "base.gguf"
    quantize_checkpoint(checkpoint=ckpt, out=base, rounds=2, progress=False)
    wins = random_stack_windows()
    out = {"windows": wins}
    for b in a.backends.split(","):
        eng = Engine(base, engram_dir=ckpt, tokenizer_path=TOKENIZER, backend=b)
        out[b] = np.stack([eng.logits(w) for w in wins])
        print(b, out[b].shape, flush=True)
    tmp = a.out.with_name(a.out.name + ".tmp.npz")
    np.savez(tmp, **out)
    tmp.replace(a.out)


if __name__ == "__main__":
    main()
