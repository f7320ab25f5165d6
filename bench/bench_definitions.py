"""Definitional questions answered by a ① base at temperature 0 through the engine (CPU backend by default):
the chat-encoded question, greedy decoding to EOS or --max-tokens, the answer as the server would return it.

    .venv/bin/python bench/bench_definitions.py --base models/ds4-tiny-base.gguf --out bench/results/definitions_v2.json
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from ds4lib.chat import encode_chat, parse_reply
from ds4lib.engine import Engine, SamplingParams

WORDS = ("ledger", "bacteria", "statute", "voltage", "mortgage", "compiler", "enzyme", "contract", "asset",
         "photosynthesis", "algorithm", "verdict")


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", type=Path, default=Path("models/ds4-tiny-base.gguf"))
    ap.add_argument("--engram-dir", type=Path, default=None)
    ap.add_argument("--cuda", action="store_true")
    ap.add_argument("--max-tokens", type=int, default=60)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    engine = Engine(args.base, engram_dir=args.engram_dir, backend="cuda" if args.cuda else "cpu")
    rows, t0 = [], time.time()
    for w in WORDS:
        q = f"What does '{w}' mean?"
        ids = encode_chat(engine.tokenizer, [{"role": "user", "content": q}])
        text = "".join(e["text"] for e in engine.generate(ids, SamplingParams(temperature=0, max_tokens=args.max_tokens))
                       if e["type"] == "token")
        rows.append({"question": q, "answer": parse_reply(text)[1]})
        print(json.dumps(rows[-1], ensure_ascii=False), flush=True)
    rec = {"base": str(args.base), "backend": engine.backend.name, "seconds": time.time() - t0, "answers": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(rec, indent=1, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main()
