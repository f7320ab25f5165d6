"""Per-step cost of constrained decoding (ds4lib.engine.constrain): llguidance's token mask and advance over the
ds4-tiny tokenizer (data/tokenizer/tokenizer.json, 8,192 ids), stepping through fixed JSON documents and a forced tool
call's DSML block token by token, next to the CPU sampler's own cost with and without the mask. One JSON line per
measurement.

    python bench/bench_constrain.py [--reps 5]
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from ds4lib.dsml import render_tool_calls
from ds4lib.engine.constrain import Constrainer, JsonFormat, ToolCallFormat
from ds4lib.ref.sampling import sample

ROOT = Path(__file__).resolve().parents[1]
TOKENIZER = ROOT / "data" / "tokenizer" / "tokenizer.json"
ORDER = {"type": "object", "properties": {
    "id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
    "customer": {"type": "object", "properties": {"name": {"type": "string"}, "email": {"type": "string",
                                                                                          "format": "email"}},
                 "required": ["name", "email"]},
    "items": {"type": "array", "items": {"type": "object", "properties": {
        "sku": {"type": "string"}, "qty": {"type": "integer", "minimum": 1}, "price": {"type": "number"}},
        "required": ["sku", "qty", "price"], "additionalProperties": False}},
    "paid": {"type": "boolean"}}, "required": ["id", "customer", "items", "paid"], "additionalProperties": False}
DOC = ('{"id": "ABC-1234", "customer": {"name": "Ada Lovelace", "email": "ada@example.org"}, "items": '
       '[{"sku": "ledger-01", "qty": 2, "price": 19.5}, {"sku": "pen", "qty": 10, "price": 1.25}], "paid": true}')
WEATHER = {"name": "get_weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 7}, "hourly": {"type": "boolean"}}, "required": ["city"]}}
CALLS = [{"name": "get_weather", "arguments": json.dumps({"city": "Paris", "unit": "c", "days": 3})},
         {"name": "place_order", "arguments": json.dumps(json.loads(DOC))}]
# the order as a tool's parameters, its id a plain string (as measured in BENCHMARKS.md; a pattern would now be
# allowed raw too)
ORDER_TOOL = {"name": "place_order",
              "parameters": {**ORDER, "properties": {**ORDER["properties"], "id": {"type": "string"}}}}
CASES = {"json_object": (lambda: JsonFormat.from_schema({"type": "object"}), DOC),
         "order_schema": (lambda: JsonFormat.from_schema(ORDER), DOC),
         "forced_call": (lambda: ToolCallFormat.from_tools([WEATHER, ORDER_TOOL]),
                         "".join(text for text, _ in render_tool_calls(CALLS)))}


def _steps(constrainer, fmt, ids):
    """Seconds of mask() and of advance() at each token of `ids`, then the final mask (EOS only)."""
    c = constrainer.start(fmt)
    t_mask, t_adv = [], []
    for t in ids:
        t0 = time.perf_counter()
        c.mask()
        t1 = time.perf_counter()
        c.advance(t)
        t_adv.append(time.perf_counter() - t1)
        t_mask.append(t1 - t0)
    assert c.finished
    return t_mask, t_adv


def _us(xs):
    a = np.asarray(xs) * 1e6
    return {"mean_us": round(float(a.mean()), 1), "p50_us": round(float(np.median(a)), 1),
            "p99_us": round(float(np.percentile(a, 99)), 1), "max_us": round(float(a.max()), 1)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    tok = Tokenizer.from_file(str(TOKENIZER))
    V = tok.get_vocab_size()
    t0 = time.perf_counter()
    constrainer = Constrainer(TOKENIZER.read_text(), n_vocab=V, eos=1)
    constrainer.start(JsonFormat.from_schema({"type": "object"}))
    print(json.dumps({"what": "llguidance tokenizer + first matcher", "vocab": V,
                      "ms": round((time.perf_counter() - t0) * 1e3, 1)}))
    for name, (make, doc) in CASES.items():
        t0 = time.perf_counter()
        fmt = make()
        t_compile = time.perf_counter() - t0
        t0 = time.perf_counter()
        constrainer.start(fmt)
        t_start = time.perf_counter() - t0
        ids = tok.encode(doc, add_special_tokens=False).ids
        masks, advs = [], []
        for _ in range(args.reps):
            m, a = _steps(constrainer, fmt, ids)
            masks += m
            advs += a
        print(json.dumps({"what": f"{name}: mask per step", "tokens": len(ids), "reps": args.reps, **_us(masks)}))
        print(json.dumps({"what": f"{name}: advance per step", **_us(advs)}))
        print(json.dumps({"what": f"{name}: schema check + start", "compile_ms": round(t_compile * 1e3, 2),
                          "start_ms": round(t_start * 1e3, 2)}))
    rng = np.random.default_rng(0)
    lg = rng.standard_normal(V).astype(np.float32)
    mask = constrainer.start(JsonFormat.from_schema({"type": "object"})).mask()
    for label, kw in (("greedy", dict(temperature=0)), ("T=0.8 top_p=0.9", dict(temperature=0.8, top_p=0.9))):
        for masked in (False, True):
            ts = []
            for step in range(50):
                t0 = time.perf_counter()
                sample(lg, seed=1, step=step, mask=mask if masked else None, **kw)
                ts.append(time.perf_counter() - t0)
            print(json.dumps({"what": f"CPU sampler {label}, {'masked' if masked else 'unmasked'}", **_us(ts)}))


if __name__ == "__main__":
    main()
