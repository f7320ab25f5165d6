"""How far does the CPU reference's DSpark draft move under one-ulp input changes? The floor under the GPU tier's
draft comparison (tests/kernels/tolerances.py "dspark_draft_trained").

    NUMBA_NUM_THREADS=1 .venv/bin/python bench/dev/draft_sensitivity.py > bench/results/draft_sensitivity_v2.txt

For the GPU test's three prompts (the first 40 / 70 / 130 tokens of the first english / code / law judging window of
ds4-tiny), the CPU backend's prompt features are appended to the draft rings as they are and with k of their
elements moved up by one BF16 ulp (k = 1, 5, 52; three seeds each), and the proposal's base logits compared: one
line per prompt with the NMSE of each (k, seed).
"""
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from ds4lib.corpus.slices import load_slice  # noqa: E402
from ds4lib.engine import Engine  # noqa: E402
from ds4lib.formats.floats import round_bf16  # noqa: E402


def nmse(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.sum((got - want) ** 2) / np.sum(want ** 2))


def main():
    e = Engine(ROOT / "models" / "ds4-tiny-base.gguf", engram_dir=ROOT / "models" / "ds4-tiny")
    cb = e.backend
    for n, sl in ((40, "english"), (70, "code"), (130, "law")):
        toks = [0] + [int(t) for t in load_slice(f"{sl}/judge").tokens[0][:n]]
        prompt, anchor = toks[:-1], toks[-1]
        f0 = np.array(cb.forward(cb.new_state(), prompt).features, dtype=np.float32)
        res = []
        for k in (1, 5, 52):
            for seed in range(3):
                f = f0.copy()
                flat = f.reshape(-1)
                idx = np.random.default_rng(seed).choice(flat.size, k, replace=False)
                bits = (round_bf16(flat[idx]).view(np.uint32) >> 16).astype(np.uint32) + 1
                flat[idx] = (bits << 16).view(np.float32)
                props = []
                for feats in (f0, f):
                    st = cb.new_state()
                    cb.forward(st, prompt)
                    cb.append_context(st, feats, np.arange(len(prompt)))
                    props.append(cb.propose(st, anchor, len(prompt) - 1))
                res.append((k, seed, nmse(props[1].base_logits, props[0].base_logits)))
        print(sl, n, " ".join(f"k{k}/s{s}:{v:.2g}" for k, s, v in res), flush=True)


if __name__ == "__main__":
    main()
