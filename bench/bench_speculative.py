"""Speculative decoding with the DSpark stages through the engine (issue 13 item 6): tokens per round, first-position
acceptance and decode speed against plain decoding, greedy and sampled, on judging-slice texts and chat prompts.

For each prompt (the first `--prompt-tokens` tokens of each judging slice's first window, then the chat prompts,
chat-encoded) and each mode (greedy; temperature 1.0 with seed s), generates `-n` tokens plainly (draft_k 0) and
speculatively (`--draft-k`, default: the engine's scheduler for greedy runs and the whole draft block for sampled
ones, since a seeded sampled request without draft_k decodes plainly),
and reports tokens per round, acceptance per draft position, and decode tokens/s of both (prefill excluded). Greedy
runs also check that the two outputs are identical.

    NUMBA_NUM_THREADS=1 OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 .venv/bin/python bench/bench_speculative.py \
        --out bench/results/speculative_cpu.json
    .venv/bin/python bench/bench_speculative.py --cuda --out bench/results/speculative_h200.json    # on a GPU

`--cuda` runs the CUDA backend (warmed up first: every kernel compiled or loaded before the first timed request).
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from ds4lib.chat import encode_chat
from ds4lib.corpus.slices import load_slice
from ds4lib.engine import Engine, SamplingParams
from ds4lib.engine.speculative import SpecStats

DOMAINS = ("finance", "code", "law", "medicine", "science", "english")
CHATS = ("What should I pack for a weekend hiking trip in the mountains?",
         "Explain in two sentences why the sky looks blue.",
         "Write a short polite email declining a meeting invitation.")


def _timed(engine, ids, params):
    """(tokens, decode seconds after the first token)."""
    t_first, out = None, []
    for tok in engine.generate_ids(ids, params):
        out.append(tok)
        if t_first is None:
            t_first = time.perf_counter()
    return out, time.perf_counter() - t_first


def run(engine, prompts, n, temps, seed, draft_k):
    B = engine.cfg.dspark_block_size
    rows = []
    for name, ids in prompts:
        for temp in temps:
            kw = dict(temperature=temp, max_tokens=n, seed=seed if temp > 0 else None)
            plain, t_plain = _timed(engine, ids, SamplingParams(draft_k=0, **kw))
            k = draft_k if draft_k is not None or temp == 0 else engine.cfg.dspark_block_size
            spec, t_spec = _timed(engine, ids, SamplingParams(draft_k=k, **kw))
            st = engine.last_spec_stats or SpecStats(B)
            rows.append({"prompt": name, "temperature": temp, "plain_tokens": len(plain), "spec_tokens": len(spec),
                         "identical": plain == spec if temp == 0 else None,
                         "plain_tok_s": (len(plain) - 1) / t_plain if t_plain > 0 else None,
                         "spec_tok_s": (len(spec) - 1) / t_spec if t_spec > 0 else None,
                         "stats": st.summary(), "accepted_at": st.accepted_at, "drafted_at": st.drafted_at})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def summarise(rows, B):
    out = {}
    for temp in sorted({r["temperature"] for r in rows}):
        rs = [r for r in rows if r["temperature"] == temp]
        acc = np.sum([r["accepted_at"] for r in rs], axis=0)
        dr = np.sum([r["drafted_at"] for r in rs], axis=0)
        rounds = sum(r["stats"]["rounds"] for r in rs)
        tokens = sum(r["stats"]["accepted"] for r in rs) + rounds
        t_plain = sum((r["plain_tokens"] - 1) / r["plain_tok_s"] for r in rs if r["plain_tok_s"])
        t_spec = sum((r["spec_tokens"] - 1) / r["spec_tok_s"] for r in rs if r["spec_tok_s"])
        out[str(temp)] = {"prompts": len(rs), "rounds": rounds,
                          "tokens_per_round": round(tokens / rounds, 4) if rounds else None,
                          "acceptance": [round(float(a / d), 4) if d else None for a, d in zip(acc, dr)],
                          "plain_tok_s": round(sum(r["plain_tokens"] - 1 for r in rs) / t_plain, 3),
                          "spec_tok_s": round(sum(r["spec_tokens"] - 1 for r in rs) / t_spec, 3),
                          "all_identical": all(r["identical"] for r in rs) if temp == 0 else None}
        out[str(temp)]["speedup"] = round(out[str(temp)]["spec_tok_s"] / out[str(temp)]["plain_tok_s"], 3)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, default=Path("models/ds4-tiny-base.gguf"))
    ap.add_argument("--slices", default=",".join(DOMAINS))
    ap.add_argument("--prompt-tokens", type=int, default=48)
    ap.add_argument("-n", type=int, default=48)
    ap.add_argument("--temps", default="0,1.0")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--draft-k", type=int, default=None)
    ap.add_argument("--no-chat", action="store_true")
    ap.add_argument("--cuda", action="store_true", help="the CUDA backend (default: CPU)")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    engine = Engine(args.model, backend="cuda" if args.cuda else "cpu")
    if args.cuda:
        engine.warm_up()
    prompts = [(f"{d}/judge", [int(t) for t in load_slice(f"{d}/judge").tokens[0][:args.prompt_tokens]])
               for d in args.slices.split(",") if d]
    if not args.no_chat:
        prompts += [(f"chat{i}", encode_chat(engine.tokenizer, [{"role": "user", "content": c}], thinking=False))
                    for i, c in enumerate(CHATS)]
    t0 = time.time()
    rows = run(engine, prompts, args.n, [float(t) for t in args.temps.split(",")], args.seed, args.draft_k)
    rec = {"model": str(args.model), "backend": engine.backend.name, "n": args.n, "prompt_tokens": args.prompt_tokens, "draft_k": args.draft_k,
           "seconds": round(time.time() - t0, 1), "summary": summarise(rows, engine.cfg.dspark_block_size),
           "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(rec, indent=1))
    print(json.dumps(rec["summary"], indent=1))


if __name__ == "__main__":
    main()
