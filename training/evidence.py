"""Evidence for ds4-tiny on the CPU, through ds4lib.ref (the exported FP4/FP8 model is the original):
perplexity on every judging slice next to a unigram baseline, greedy and sampled continuations, and chat
answers. Writes a JSON record; the numbers go into BENCHMARKS.md and models/ds4-tiny/README.md.

    .venv/bin/python -m training.evidence --model models/ds4-tiny --out training/runs/evidence.json
"""
from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import numpy as np

from ds4lib.chat import encode_chat, parse_reply
from ds4lib.corpus.slices import load_slice
from ds4lib.ref import ReferenceModel

DOMAINS = ("finance", "code", "law", "medicine", "science", "english")


def log_softmax(x):
    x = x.astype(np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def slice_ppl(model, name):
    sl = load_slice(f"{name}/judge")
    nll, n = 0.0, 0
    for w in sl.tokens:
        lp = log_softmax(model.logits(w[:-1].astype(np.int64)))
        nll -= lp[np.arange(len(w) - 1), w[1:]].sum()
        n += len(w) - 1
    return math.exp(nll / n), n


def unigram_ppl(train_dir: Path, name, vocab):
    counts = np.zeros(vocab, dtype=np.float64)
    for f in sorted(train_dir.glob("*.npy")):
        counts += np.bincount(np.load(f), minlength=vocab)[:vocab]
    p = (counts + 1) / (counts.sum() + vocab)
    toks = load_slice(f"{name}/judge").tokens[:, 1:].reshape(-1)
    return math.exp(-np.log(p[toks]).mean())


def generate(model, ids, n, temperature=0.0, seed=0, stop=(1,)):
    state = model.new_state()
    out = model.forward(np.asarray(ids, dtype=np.int64), state, last_only=True)
    res = []
    for step in range(n):
        if temperature == 0:
            t = int(np.argmax(out.logits[-1]))
        else:
            from ds4lib.ref.sampling import sample
            t = sample(out.logits[-1], temperature=temperature, seed=seed, step=step)
        res.append(t)
        if t in stop:
            break
        out = model.forward([t], state)
    return res


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", type=Path, default=Path("models/ds4-tiny"))
    ap.add_argument("--train", type=Path, default=Path("cache/corpus/train"))
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--skip", default="", help="comma list of parts to skip: ppl, generation")
    args = ap.parse_args(argv)
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(args.model / "tokenizer.json"))
    model = ReferenceModel.load(args.model)
    rec = json.loads(args.out.read_text()) if args.out.exists() else {}
    rec.update(model=str(args.model))
    skip = set(args.skip.split(","))
    t0 = time.time()
    for d in ([] if "ppl" in skip else DOMAINS):
        rec.setdefault("ppl", {})
        rec.setdefault("unigram_ppl", {})
        ppl, n = slice_ppl(model, d)
        rec["ppl"][d] = {"ppl": ppl, "tokens": n}
        if args.train.exists():
            rec["unigram_ppl"][d] = unigram_ppl(args.train, d, model.cfg.vocab_size)
        print(d, rec["ppl"][d], rec["unigram_ppl"].get(d), flush=True)
    if "ppl" not in skip:
        rec["ppl_seconds"] = time.time() - t0
    if "generation" in skip:
        args.out.write_text(json.dumps(rec, indent=1) + "\n")
        return
    prompts = ["The Lord said unto Moses,", "It is a truth universally acknowledged", "def parse_args(argv):\n",
               "Permission is hereby granted, free of charge,", "A balance sheet lists"]
    rec["continuations"] = []
    for p in prompts:
        ids = [0] + tok.encode(p).ids
        greedy = tok.decode(generate(model, ids, 40), skip_special_tokens=False)
        sampled = tok.decode(generate(model, ids, 40, temperature=1.0, seed=1), skip_special_tokens=False)
        rec["continuations"].append({"prompt": p, "greedy": greedy, "sampled_t1": sampled})
    rec["chat"] = []
    for q in ["What does 'ledger' mean?", "What does 'bacteria' mean?", "What does 'statute' mean?",
              "What does 'voltage' mean?"]:
        ids = encode_chat(tok, [{"role": "user", "content": q}])
        text = tok.decode(generate(model, ids, 60), skip_special_tokens=False)
        rec["chat"].append({"question": q, "answer": parse_reply(text)[1], "raw": text})
    t = time.time()
    generate(model, [0] + tok.encode("The").ids, 32, stop=())
    rec["ref_decode_tok_per_s"] = 32 / (time.time() - t)
    args.out.write_text(json.dumps(rec, indent=1) + "\n")
    print(json.dumps(rec, indent=1))


if __name__ == "__main__":
    main()
