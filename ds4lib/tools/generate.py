"""`ds4 -m base.gguf [--zchain DIR] [--posttrain DIR] [--engram-dir DIR] [--cuda] -p PROMPT [--temp T]
[--top-p P] [--top-k K] [--min-p M] [-n N] [--seed S] [--think] [--raw]`: stream a generation.

The prompt is chat-encoded (non-thinking by default, `--think` for thinking mode); `--raw` feeds it as plain
text after BOS. Sampling defaults follow the model card (temperature 1.0, top_p 1.0); `--temp 0` is greedy.
"""
from __future__ import annotations

import argparse
import sys
import time

from ds4lib.tools.argtypes import finite_float, int_at_least, seed
from ds4lib.tools.cli import SUBCOMMANDS
from ds4lib.tools.engine_args import add_engine_args, open_engine

__all__ = ["main", "build_parser"]


def build_parser():
    p = argparse.ArgumentParser(prog="ds4", description="Generate with a ds4 stack (subcommands: ds4 "
                                + " | ".join(SUBCOMMANDS) + ")")
    add_engine_args(p)
    p.add_argument("-p", "--prompt", required=True)
    p.add_argument("--temp", type=finite_float(0.0), default=1.0)
    p.add_argument("--top-p", type=finite_float(0.0, 1.0, lo_open=True), default=1.0)
    p.add_argument("--top-k", type=int_at_least(0), default=0)
    p.add_argument("--min-p", type=finite_float(0.0, 1.0), default=0.0)
    p.add_argument("-n", "--max-tokens", type=int_at_least(1), default=256)
    p.add_argument("--seed", type=seed, default=None, help="0 .. 2^64 - 1 (default: a fresh one per run)")
    p.add_argument("--think", action="store_true", help="thinking mode (reasoning before </think>)")
    p.add_argument("--raw", action="store_true", help="no chat template: BOS + prompt")
    p.add_argument("--stats", action="store_true", help="print tokens/s (and speculative decoding's tokens per round, "
                   "drafted and accepted counts, acceptance per draft position) to stderr")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from ds4lib.chat import encode_chat
    from ds4lib.engine import EngineError, SamplingParams
    try:
        params = SamplingParams(temperature=args.temp, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
                                max_tokens=args.max_tokens, seed=args.seed)
        engine = open_engine(args)
    except (EngineError, ValueError) as e:
        print(f"ds4: {e}", file=sys.stderr)
        return 2
    if args.raw:
        ids = [0] + engine.encode(args.prompt)
    else:
        ids = encode_chat(engine.tokenizer, [{"role": "user", "content": args.prompt}], thinking=args.think)
    t0, n, t_first = time.time(), 0, None
    try:
        for ev in engine.generate(ids, params):
            if ev["type"] == "token":
                n += 1
                if t_first is None:
                    t_first = time.time()
                sys.stdout.write(ev["text"])
                sys.stdout.flush()
            else:
                sys.stdout.write("\n")
    except EngineError as e:
        print(f"ds4: {e}", file=sys.stderr)
        return 2
    if args.stats:
        t1 = time.time()
        first = (t_first or t1) - t0
        rate = (n - 1) / (t1 - t_first) if n > 1 and t1 > t_first else float("nan")
        print(f"[prompt {len(ids)} tokens; first token after {first:.2f} s (prefill; with --cuda the kernels were "
              f"compiled or loaded before, by the warm-up); then {n - 1} tokens at {rate:.1f} tokens/s]",
              file=sys.stderr)
        st = engine.last_spec_stats
        if st is not None:
            acc = " ".join("-" if d == 0 else f"{a / d:.2f}" for a, d in zip(st.accepted_at, st.drafted_at))
            print(f"[speculative: {st.rounds} rounds at {st.tokens_per_round:.2f} tokens per round, {st.plain_steps} "
                  f"plain steps; drafted {st.drafted}, accepted {st.accepted}; acceptance per draft position {acc}]",
                  file=sys.stderr)
        elif not engine.speculative:
            print("[speculative decoding off]", file=sys.stderr)
        else:
            print("[speculative: this request decoded plainly (no round could pay, a seeded sampled request, "
                  "or structured output)]", file=sys.stderr)
    return 0
