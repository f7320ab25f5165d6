"""A ③ post-training file on requests, solved on them or held out: do their decisions move, and what does greedy
generation write before and after? (docs/design.md §4; what bench/bench_posttrain.py and notebooks/posttrain.ipynb
report.)

For each request, through the path `ds4 posttrain` uses (ds4lib.posttrain.solve: chat-encoded prompt, greedy answer
of the ① + ② stack up to the right answer's length, plain decode, the text-aware judge): the first position where
the answer leaves the right one is its decision point (right token a). Then, with the ③ mounted, the logits of that
same row (the same prefix, the generated part through the decode path, as generation computes it) say whether a is
now the top token, and a fresh greedy answer says whether the whole answer is now right. Requests already right
without the ③ are counted and checked to stay right. Both answers are kept as text: they are the free-generation
examples before and after (greedy, not teacher-forced).

This module owns the measurement only; it writes nothing. Shapes: P prompt tokens, V vocab.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ds4lib.report.summary import to_jsonable

__all__ = ["RequestsEffect", "measure_requests", "generation_examples"]


@dataclass
class RequestsEffect:
    """One requests file with and without the ③."""
    requests: str
    n: int
    decision_points: int              # wrong answers with a decision point (skipped ones excluded)
    flipped_with_posttrain: int       # of those, decision rows whose top token is now the right one
    right_before: int                 # whole answers right without the ③
    right_after: int                  # with it
    right_kept: int                   # right before and still right after
    skipped: int                      # answers that spell the right text otherwise (no decision point)
    seconds: float
    rows: list = field(default_factory=list)   # per request: id, prompt, answer, before, after, status, ...

    def as_dict(self) -> dict:
        return to_jsonable(self)

    def summary(self) -> dict:
        """The counts without the per-request rows (one table row)."""
        return {k: v for k, v in self.as_dict().items() if k != "rows"}


def measure_requests(*, base, zchain, posttrain, requests, engram_dir=None, backend: str = "cpu", tokenizer=None,
                     progress: bool = False) -> list:
    """-> [RequestsEffect], one per requests file in `requests` (a path or a list of paths), for the ① `base` +
    ② `zchain` stack against the same stack with the ③ `posttrain` mounted. Raises PosttrainError on a requests
    file it refuses (ds4lib.posttrain.solve.read_requests), EngineError / SidecarError on a stack the engine
    refuses (e.g. a ③ not fingerprinted to this ②)."""
    from ds4lib.engine import Engine
    from ds4lib.posttrain.solve import _greedy, _judge, _progress, _text, _tokenise, read_requests
    from ds4lib.tokenizer import TextEncoder
    paths = [requests] if isinstance(requests, (str, Path)) else list(requests)
    if not paths:
        raise ValueError("no requests files given")
    files = [(str(p), read_requests(p)) for p in paths]          # refuse a bad file before any engine work

    def open_engine(pt):
        return Engine(base, zchain=zchain, posttrain=pt, engram_dir=engram_dir, backend=backend,
                      tokenizer_path=tokenizer)

    two, three = open_engine(None), open_engine(posttrain)
    enc = TextEncoder(two.tokenizer)
    out = []
    for label, reqs in files:
        t0 = time.perf_counter()
        eff = RequestsEffect(requests=label, n=len(reqs), decision_points=0, flipped_with_posttrain=0,
                             right_before=0, right_after=0, right_kept=0, skipped=0, seconds=0.0)
        for it in _progress(_tokenise(two, enc, reqs), progress, f"measure {Path(label).name}"):
            eff.rows.append(_measure_one(two, three, enc, it, eff, _greedy, _judge, _text))
        eff.seconds = round(time.perf_counter() - t0, 1)
        out.append(eff)
    return out


def _measure_one(two, three, enc, it, eff: RequestsEffect, greedy, judge, text) -> dict:
    """One request: its answers before and after, and its decision row with the ③ (updates eff's counts)."""
    n = len(it.answer_ids)
    before = greedy(two, it.prompt_ids, n)
    v = judge(two, enc, before, it.answer_ids)
    after = greedy(three, it.prompt_ids, n)
    now_right = judge(three, enc, after, it.answer_ids).j is None
    eff.right_after += int(now_right)
    row = {"id": it.req.id, "prompt": it.req.prompt, "answer": it.req.answer, "before": text(two, before),
           "after": text(three, after), "right_after": now_right}
    if v.j is None:
        eff.right_before += 1
        eff.right_kept += int(now_right)
        return {**row, "status": "right", "right_before": True}
    if v.skip:
        eff.skipped += 1
        return {**row, "status": "skipped", "right_before": False, "skip": v.skip}
    eff.decision_points += 1
    logits = three.logits(list(it.prompt_ids) + before[:v.j], split=len(it.prompt_ids))[-1]     # [V]
    top = int(np.argmax(logits))
    eff.flipped_with_posttrain += int(top == v.a)
    return {**row, "status": "wrong", "right_before": False, "divergence": v.j, "right_text": text(two, [v.a]),
            "written_text": text(two, [before[v.j]]), "top_after_text": text(two, [top]), "flipped": top == v.a}


def generation_examples(effects, n: int = 3) -> list:
    """Up to n rows per requests file for a table of free generations before and after: the requests whose answer
    changed first (flipped decisions first among them), then unchanged ones; texts as generated, with a newline
    shown as ⏎ and | escaped so that a row stays one Markdown table row."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"n must be an integer ≥ 0, got {n!r}")
    rows = []
    for eff in effects:
        ranked = sorted(eff.rows, key=lambda r: (r["before"] == r["after"], not r.get("flipped", False)))
        rows += [{"requests": Path(eff.requests).name, "id": r["id"], "prompt": _cell(r["prompt"]),
                  "right": _cell(r["answer"]), "before": _cell(r["before"]), "after": _cell(r["after"]),
                  "right_before": r["right_before"], "right_after": r["right_after"]} for r in ranked[:n]]
    return rows


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", "⏎")
