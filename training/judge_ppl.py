"""Judging-slice perplexity and median top-1 margin of an official-format checkpoint through the training model
(PyTorch, the FP4/FP8 values the checkpoint stores; CPU or GPU). Much faster than the NumPy reference on the CPU
and equal to it up to summation order (tests/training/test_trainer.py checks the agreement on the shipped weights).

    .venv/bin/python -m training.judge_ppl --model models/ds4-tiny --slices finance,code --out training/runs/x.json

Every judging window (24 x 512 tokens) is scored as its own sequence from position 0, without BOS, as
training/evidence.py does with the reference. Imports torch: training only.
"""
from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tokenizers import Tokenizer

from ds4lib.tokenmap import compressed_token_map
from training.export import load_model

DOMAINS = ("finance", "code", "law", "medicine", "science", "english")


@torch.no_grad()
def judge(model, tokens, batch: int = 4, device="cpu") -> dict:
    """tokens int [W, N]: perplexity of predicting tokens[:, 1:] and the median top-1 - top-2 logit margin."""
    wins = torch.from_numpy(np.asarray(tokens, dtype=np.int64)).to(device)
    nll, n, margins = 0.0, 0, []
    for i in range(0, len(wins), batch):
        w = wins[i:i + batch]
        lg = model(w[:, :-1])[0].float()                                                     # [b, N-1, V]
        nll += F.cross_entropy(lg.reshape(-1, lg.shape[-1]), w[:, 1:].reshape(-1), reduction="sum").item()
        n += w[:, 1:].numel()
        top2 = lg.topk(2, -1).values
        margins.append((top2[..., 0] - top2[..., 1]).reshape(-1).cpu().numpy())
    return {"ppl": math.exp(nll / n), "median_top1_margin": float(np.median(np.concatenate(margins))), "tokens": n}


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", type=Path, default=Path("models/ds4-tiny"))
    ap.add_argument("--tokenizer", type=Path, default=Path("data/tokenizer/tokenizer.json"))
    ap.add_argument("--slices", default=",".join(DOMAINS))
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    tmap, _ = compressed_token_map(Tokenizer.from_file(str(args.tokenizer)))
    model = load_model(args.model, tmap)
    rec = {"model": str(args.model), "ppl": {}}
    for d in args.slices.split(","):
        t = time.time()
        rec["ppl"][d] = judge(model, np.load(f"data/slices/{d}/judge.tokens.npy"))
        print(d, rec["ppl"][d], f"{time.time() - t:.0f} s", flush=True)
    args.out.write_text(json.dumps(rec, indent=1) + "\n")


if __name__ == "__main__":
    main()
