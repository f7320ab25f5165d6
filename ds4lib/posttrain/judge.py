"""The judging-slice gate of a ③ candidate (docs/posttrain.md "Gates"): Same top-1 of ② + ③ against ② alone on
judging slices (the five numbers of ds4lib.eval, as `ds4 eval` computes them), before the candidate is installed.

Why a gate and not only a report: the day's rows and the ordinary-text rows are a sample; what the ③ costs on the text
the stack serves is measured only by the evaluation. Cost on the 2-core dev box: about two minutes a slice and stack
(24 windows of 512 tokens through the engine; the teacher's logits are cached by ds4lib.eval.Teacher), so `ds4
posttrain` runs it only when asked (--judge-slice) and the nightly notebook asks. The ② alone numbers do not depend on
the candidate: they are kept in `cache_dir/posttrain_judge/` per (base file, sidecar fingerprint, slice, windows,
backend) and computed once.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

__all__ = ["judge_candidate", "MAX_TOP1_DROP"]

MAX_TOP1_DROP = 0.002           # gate: Same top-1 of ② + ③ at most this far below ② alone (0.2 pp)


def _evaluate(engine, teacher, tokens, windows):
    from ds4lib.eval import evaluate_windows
    comp, _ = evaluate_windows(engine, teacher, tokens[:windows])
    return comp.as_dict()


def judge_candidate(*, open_engine, candidate, slices, max_drop: float = MAX_TOP1_DROP, original=None,
                    cache_dir, base_key: str, windows=None) -> dict:
    """Same top-1 of ② + `candidate` against ② alone on each of `slices` (names such as finance/judge, or
    {name: token windows [W, T]}).
    open_engine(posttrain=None | path) opens the stack; `base_key` names the ② stack in the cache (the base file's
    sha256 and the sidecar's fingerprint). Returns {"slices": {name: {"base", "candidate" (the five numbers),
    "drop_pp", "passed"}}, "max_drop_pp", "passed", "reasons", "seconds"}."""
    import time

    from ds4lib.corpus.slices import load_slice
    from ds4lib.eval import Teacher
    t0 = time.perf_counter()
    texts = dict(slices) if isinstance(slices, dict) else {name: load_slice(name).tokens for name in slices}
    two = open_engine()
    three = open_engine(posttrain=candidate)
    teacher = Teacher(Path(original or two.engram_dir), Path(cache_dir) / "teacher")
    folder = Path(cache_dir) / "posttrain_judge"
    out, reasons = {}, []
    for name, tokens in texts.items():
        key = f"{base_key}-{name.replace('/', '_')}-w{windows or 'all'}-{two.backend.name}.json"
        f = folder / key
        if f.is_file():
            base = json.loads(f.read_text())
        else:
            base = _evaluate(two, teacher, tokens, windows)
            folder.mkdir(parents=True, exist_ok=True)
            tmp = f.with_name(f"{f.name}.{os.getpid()}.partial")
            tmp.write_text(json.dumps(base) + "\n")
            os.replace(tmp, f)
        cand = _evaluate(three, teacher, tokens, windows)
        drop = base["same_top1"] - cand["same_top1"]
        ok = drop <= max_drop + 1e-12
        out[name] = {"base": base, "candidate": cand, "drop_pp": 100 * drop, "passed": ok}
        if not ok:
            reasons.append(f"{name}: Same top-1 {100 * cand['same_top1']:.2f}% against ② alone "
                           f"{100 * base['same_top1']:.2f}% ({-100 * drop:+.2f} pp, more than the "
                           f"{100 * max_drop:.2f} pp allowed)")
    return {"slices": out, "max_drop_pp": 100 * max_drop, "passed": not reasons, "reasons": reasons,
            "seconds": time.perf_counter() - t0}
