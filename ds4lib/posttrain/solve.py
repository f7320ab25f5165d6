"""The ③ post-training solve from requests (docs/design.md §4): `ds4 posttrain`, callable as `solve_posttrain`.

Requests. A JSON-lines file, one object a line: {"id": ..., "prompt": text, "answer": text}, the answer being the
right one. Blank lines are skipped; anything else that is not such an object is refused by its line number. The
prompt is chat-encoded as `ds4 -p` encodes it (ds4lib.chat.encode_chat, one user message, non-thinking); the right
answer's tokens are what the chat template appends for a completed assistant turn with that content after the
prompt, i.e. the answer's text tokens and then EOS (a right answer also ends where it should).

Decision points. For each request the model writes its own answer at temperature 0 through the engine's generation
path (Engine.generate_ids), at most as many tokens as the right answer has. It runs with `draft_k=0`: plain
prefill then one-token decode steps, exactly the calls the capture replays (ds4lib.posttrain.capture: position p is
decided by the prompt's prefill for p = P, else by the decode step that fed generated[p − P − 1]); greedy
speculative decoding writes the same tokens (ds4lib.engine.engine) but computes them in other calls. The first index
j where the generated tokens and the right answer's tokens differ is the request's one decision point: position
P + j, a = the right answer's token there (b, the strongest other token, is what the model wrote). Later positions
are not used: they are conditioned on the wrong token. BPE spells most texts in several ways, and the model does
not always use the tokenizer's spelling, so differing tokens are checked against the texts (`_judge`): a generation
that spells the right text otherwise and then ends is right; one that spells part of it otherwise has its decision
point at the first token whose text leaves the right text, with a = the first token of the rest of the right text
(EOS when none is left); one cut by the token budget while still on the right text is skipped (no rows). The rows
are captured (capture_rows) on prompt + generated[:j + 1]: the last token given is never fed, so the decode steps
feed generated[:j], the prefix the model wrote on the right text, and the row that decides position P + j is the one
generation computed; the positions P .. P + j − 1 become constraint rows (keep the token the model wrote there). A
request the model already answers right contributes constraint rows on every generated position, so that the ③
keeps its answer. The capture must reproduce the generation (top-1 = the written token on every row); otherwise the
solve stops.

Solve and gates. Each captured position gives `rivals` rows: the right token (decision point) or the written one
(other positions) against each of its `rivals` strongest other tokens, one group (a pair alone lets a third token
overtake both: on day 1 of data/posttrain/general, with one row per position, 8 of 29 decision points whose right
token beat the written one in a real forward were still not the top-1). All requests' rows are stacked into one
MarginProblem of the last backbone MoE layer and solved by ds4lib.solvers.margins.solve_margins (row-space CG, the
FP4 active set, rows the rounding pushes below κ held at κ), then up to `rival_passes` times again with the tokens
outside a position's rows that the solved δ is predicted to bring near its token added as rows of that position
(ds4lib.posttrain.rivals; collect_rows keeps each request's capture for it); flipped and kept are counted per
position over all of a position's rows. A
candidate whose predicted flipped share is below `min_flip` or whose kept share is below `min_kept` is not
installed: it is written, as a complete ③ directory with its report.json, to
`<out parent>/rejected/<out name>-<UTC timestamp>/` and never deleted. A candidate that passes is written into
`<out>.partial`, verified there (below), given its report.json and renamed to `out`; an existing `out` is kept as
`<out>.old` and the copy older than that is removed only once the new one is in place (the sidecar writer's rule,
docs/formats.md). report.json is not listed in the manifest, so it changes neither the directory's fingerprint nor
what the engine reads.

Ordinary text (ds4lib.posttrain.keep). A day's rows protect only the day's positions; the ③ of day 1 solved on them
alone changed the ② stack's top-1 at 12 % (finance/fit) to 17 % (english/fit) of ordinary positions in a real forward
and cost 1.66 / 2.71 pp of Same top-1 on finance/judge / english/judge. So `keep_positions` positions of the
sidecar's fit slices and english/fit give "keep top-1" rows (top-1 against `keep_rivals` rivals), and their normal
matrix's diagonal, weight `keep_rho`, weighs the ridge per gain (solvers/margins.py "Weighted ridge"): gains that
ordinary text routes through at large amplitude cost more. Solved as explicit constraint rows instead (`keep_as_rows`), 1,024 positions kept their
own top-1 but not that of other windows (BENCHMARKS.md); the diagonal generalises because it prices every channel.
The day's counts and gates are over the day's own positions; the ordinary positions' predicted kept share is reported.

Judging gate (ds4lib.posttrain.judge; `judge_slices`, off unless given: about two minutes a slice). A candidate that
passes every gate above is evaluated on the judging slices with ② alone and with the candidate mounted; if its Same
top-1 falls more than `max_top1_drop` below ② alone on any of them it goes to rejected/ with the figures.

Verification (real numbers, not the linear prediction). The engine is reopened with the ② and the new ③ and the same
rows are captured again (capture_positions, the same (a, b) pairs as in check_rows): real margin changes against the
predicted ones (correlation), real flipped (a is now the top-1 of its row) and kept (a constraint row's top-1 is
unchanged), and every request is generated again: how many answers are now right, which were right and no longer
are, and where each now first diverges. The gates then apply to the real flipped and kept shares as well: a
candidate that passes on the prediction but not in the real forward goes to `rejected/` with its real numbers (on
day 2 of data/posttrain/general the prediction said 30/30 flipped, the real forward 22/30). With verify=False only
the predicted numbers are gated.

Refusals raise PosttrainError (a ValueError) naming what is wrong: missing files, a bad requests line, a --zchain
that is not a complete sidecar of this base, an `out` that exists and is not a ③ directory of this model, requests
whose tokens the model cannot take, and NoDecisionPoints (every answer already right: nothing is written).

Shapes: P prompt tokens, G generated tokens, N rows, K active experts, D hidden, E experts.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

from ds4lib.posttrain.judge import MAX_TOP1_DROP
from ds4lib.posttrain.rivals import RIVAL_PASSES
from ds4lib.report.summary import to_jsonable

__all__ = ["PosttrainError", "NoDecisionPoints", "Request", "PosttrainReport", "read_requests", "solve_posttrain",
           "format_report", "RequestRows", "collect_rows", "TAU", "KEEP_POSITIONS", "KEEP_RIVALS", "KEEP_RHO",
           "MAX_TOP1_DROP", "RIVAL_PASSES", "RHO", "LAM", "KAPPA", "RIVALS", "ROUNDS", "MIN_FLIP", "MIN_KEPT", "REPORT"]

TAU = 2.0              # target margin ℓ_a − ℓ_b of a decision point
RHO = 1.0              # weight of a constraint row (a decision point weighs 1)
LAM = 1e-2             # ridge on δ (> 0)
RIVALS = 16            # rows per position: a against its strongest other tokens (solvers/margins.py "Groups")
KAPPA = 0.25           # the margin a constraint row the FP4 rounding pushed down is held at (solvers/margins.py)
ROUNDS = 8             # FP4 lattice rounds of the active set
MIN_FLIP = 0.9         # gate: predicted flipped share of the decision points
MIN_KEPT = 0.997       # gate: predicted kept share of the constraint rows
KEEP_POSITIONS = 2048  # ordinary-text positions whose "keep top-1" rows weigh the ridge (ds4lib.posttrain.keep)
KEEP_RIVALS = 4        # rows per ordinary position
KEEP_RHO = 1e5         # weight of the ordinary rows' squared changes in the ridge (solvers/margins.py "Weighted ridge");
                       # the shipped finance ③'s setting: with the rival pass days 1-4 keep 573/573 at 1e5, 571/573 at 3e4
REPORT = "report.json"


class PosttrainError(ValueError):
    """The inputs of a post-training solve cannot be used (the message names the file, line or request)."""


class NoDecisionPoints(PosttrainError):
    """Every request's answer is already right: there is nothing to flip and nothing is written."""


@dataclass
class Request:
    id: object
    prompt: str
    answer: str
    line: int = 0          # 1-based line in the requests file (0: given from Python)


@dataclass
class PosttrainReport:
    status: str                       # "installed" | "rejected"
    out: Path                         # where the candidate was written (`out`, or its rejected/ folder)
    requested_out: Path               # the `out` asked for
    previous: Path | None             # `<out>.old`, the copy that was in `out` before (None if there was none)
    params: dict
    n_requests: int
    right_before: int                 # requests the model already answered right
    skipped: int                      # requests whose tokens spell the right text otherwise (no decision point)
    decision_points: int
    constraint_rows: int
    predicted: dict                   # flipped, flipped_share, reached_tau, kept, kept_share, round, δ size
    cg_iterations: list               # per lattice round
    rounds: list                      # solve_margins' per-round history
    gate: dict                        # min_flip, min_kept, passed, reasons
    fingerprint: str                  # of the written ③ directory
    base_fnv: str                     # the ② it stacks on
    solve_seconds: float
    generate_seconds: float
    capture_seconds: float
    verify_seconds: float = 0.0
    real: dict | None = None          # the verification's numbers (None: not verified, i.e. rejected)
    margins: dict | None = None       # per row [N]: decision (bool), before, predicted (lattice), real (or None)
    judge: dict | None = None         # the judging-slice gate's numbers (ds4lib.posttrain.judge; None: not run)
    requests: list = field(default_factory=list)    # one dict per request

    @property
    def installed(self) -> bool:
        return self.status == "installed"

    def as_dict(self) -> dict:
        return to_jsonable(self)


# ---------------------------------------------------------------------------------------------------- requests
def read_requests(path) -> list:
    """The requests of a JSON-lines file -> [Request]. Refuses (PosttrainError, naming the line) a line that is
    not a JSON object, lacks "id", "prompt" or "answer", has a prompt or answer that is not a non-empty string, an
    id that is not a string or integer, or repeats an id; and a file without requests."""
    path = Path(path)
    if not path.is_file():
        raise PosttrainError(f"{path}: no such requests file")
    out, seen = [], {}
    with open(path, encoding="utf-8") as f:
        for n, text in enumerate(f, 1):
            if not text.strip():
                continue
            where = f"{path} line {n}"
            try:
                obj = json.loads(text)
            except json.JSONDecodeError as e:
                raise PosttrainError(f"{where}: not JSON ({e.msg} at column {e.colno})") from None
            out.append(_request(obj, where, n, seen, f"line {n}"))
    if not out:
        raise PosttrainError(f"{path}: no requests (one JSON object a line: id, prompt, answer)")
    return out


def _request(obj, where: str, line: int, seen: dict, short: str) -> Request:
    if not isinstance(obj, dict):
        raise PosttrainError(f"{where}: expected a JSON object with id, prompt and answer, got {type(obj).__name__}")
    missing = [k for k in ("id", "prompt", "answer") if k not in obj]
    if missing:
        raise PosttrainError(f"{where}: missing field{'s' if len(missing) > 1 else ''} {', '.join(missing)}")
    rid = obj["id"]
    if isinstance(rid, bool) or not isinstance(rid, (str, int)):
        raise PosttrainError(f"{where}: id must be a string or an integer, got {rid!r}")
    for k in ("prompt", "answer"):
        if not isinstance(obj[k], str) or not obj[k]:
            raise PosttrainError(f"{where}: {k} must be a non-empty string")
    key = json.dumps(rid)
    if key in seen:
        raise PosttrainError(f"{where}: id {rid!r} was already given on {seen[key]}")
    seen[key] = short
    return Request(id=rid, prompt=obj["prompt"], answer=obj["answer"], line=line)


def _as_requests(requests) -> tuple[list, str]:
    """A path or an iterable of Request / dicts -> ([Request], a label for the report)."""
    if isinstance(requests, (str, Path)):
        from ds4lib.quant import file_sha256
        return read_requests(requests), f"{requests} (sha256 {file_sha256(requests)[:16]})"
    seen, out = {}, []
    for i, r in enumerate(requests):
        if isinstance(r, Request):
            r = {"id": r.id, "prompt": r.prompt, "answer": r.answer}
        out.append(_request(r, f"request {i}", 0, seen, f"request {i}"))
    if not out:
        raise PosttrainError("no requests given")
    return out, "(given in Python)"


def _label(r: Request) -> str:
    return f"request {r.id!r}" + (f" (line {r.line})" if r.line else "")


# ---------------------------------------------------------------------------------------------------- checks
def _check_inputs(base: Path, zchain: Path, out: Path):
    """-> the model config. Refuses missing files, a --zchain that is not a complete sidecar of this base, and an
    `out` that exists and is not a ③ directory of this model."""
    from ds4lib.formats.gguf import BaseFile, BaseFileError
    from ds4lib.formats.sidecar import SidecarError, read_sidecar
    if not base.is_file():
        raise PosttrainError(f"{base}: no such base file")
    if not zchain.is_dir():
        raise PosttrainError(f"--zchain {zchain}: no such sidecar directory")
    try:
        bf = BaseFile.open(base)
    except BaseFileError as e:
        raise PosttrainError(f"{base}: {e}") from None
    cfg = bf.config
    try:
        sc = read_sidecar(zchain, cfg)
    except SidecarError as e:
        raise PosttrainError(f"--zchain {e}") from None
    if sc.kind != "sidecar":
        raise PosttrainError(f"--zchain {zchain}: is a {sc.kind!r} directory, not a ② sidecar")
    notes = sc.manifest.get("notes", {})
    if notes.get("status") == "solving":
        raise PosttrainError(f"--zchain {zchain}: the sidecar is still being solved (manifest status 'solving'); "
                             f"a ③ stacks on a finished ②")
    if notes.get("base_sha256"):
        from ds4lib.quant import file_sha256
        got = file_sha256(base)
        if got != notes["base_sha256"]:
            raise PosttrainError(f"--zchain {zchain}: solved against base {notes['base_sha256'][:16]}..., but "
                                 f"{base} is {got[:16]}...; a ③ must be solved on the stack it will run with")
    if out.exists() or out.is_symlink():
        if not out.is_dir():
            raise PosttrainError(f"--out {out}: exists and is not a directory; choose another --out")
        if out.resolve() == zchain.resolve():
            raise PosttrainError(f"--out {out}: is the --zchain directory; choose another --out")
        try:
            read_sidecar(out, cfg, expect_kind="posttrain")
        except SidecarError as e:
            raise PosttrainError(f"--out {out}: exists and is not a ③ post-training directory of this model ({e}); "
                                 f"choose another --out") from None
    return cfg


# ---------------------------------------------------------------------------------------------------- per request
@dataclass
class _Item:
    req: Request
    prompt_ids: list
    answer_ids: list
    generated: list = field(default_factory=list)
    j: int | None = None              # the decision point's index in the generated part (None: right)
    a: int | None = None              # the right token there
    skip: str | None = None           # why the request gives no rows (_judge)
    rows: slice | None = None         # this request's rows in the stacked problem
    meta: object = None               # its RowMeta
    cap: object = None                # its PositionCapture (the rival pass predicts every token there)
    after: list | None = None         # the tokens generated again with the candidate mounted (verification)
    after_j: int | None = None        # where those leave the right answer (None: right)


def _tokenise(engine, enc, items_in) -> list:
    """Requests -> [_Item] with the chat-encoded prompt and the right answer's tokens; refuses what the model
    cannot take (ids outside its vocabulary, more positions than its context)."""
    from ds4lib.chat import encode_chat
    V, ctx = engine.cfg.vocab_size, engine.context_length
    items = []
    for r in items_in:
        user = [{"role": "user", "content": r.prompt}]
        prompt = encode_chat(enc, user)
        full = encode_chat(enc, user + [{"role": "assistant", "content": r.answer}], add_generation_prompt=False)
        if full[:len(prompt)] != prompt:
            raise PosttrainError(f"{_label(r)}: the chat template does not encode the answer after the prompt")
        answer = full[len(prompt):]
        for name, ids in (("prompt", prompt), ("answer", answer)):
            bad = [t for t in ids if not 0 <= t < V]
            if bad:
                raise PosttrainError(f"{_label(r)}: the {name} encodes to token id {bad[0]}, outside the model's "
                                     f"vocabulary [0, {V})")
        if len(prompt) + len(answer) > ctx:
            raise PosttrainError(f"{_label(r)}: prompt and answer need {len(prompt) + len(answer)} positions; the "
                                 f"model's context is {ctx}")
        items.append(_Item(req=r, prompt_ids=prompt, answer_ids=answer))
    return items


def _greedy(engine, prompt_ids, n: int) -> list:
    from ds4lib.engine import SamplingParams
    params = SamplingParams(temperature=0.0, max_tokens=n, draft_k=0)
    return [int(t) for t in engine.generate_ids(list(prompt_ids), params)]


def _text(engine, ids) -> str:
    return engine.tokenizer.decode([int(t) for t in ids], skip_special_tokens=False)


@dataclass
class _Verdict:
    j: int | None                     # index in the generated part of the decision point; None = right
    a: int | None = None              # the right token there
    skip: str | None = None           # why no decision point is taken (the request then gives no rows)


def _judge(engine, enc, generated, answer) -> _Verdict:
    """Where the generation leaves the right answer (answer = its tokens, EOS last). Equal tokens: right. Else the
    texts decide, so that a model that spells the right text with other tokens than the tokenizer's (BPE allows
    many spellings) is not 'corrected' into the canonical one: j is the first generated token whose text leaves the
    right text (the right text followed by EOS counts as the end; a token after the full text, or EOS before it,
    leaves it). The right token there is the answer's own token where the generation so far has the answer's
    tokens (then j is also the first index where the token lists differ); after another spelling, the first token
    of the rest of the right text (EOS when nothing is left). A generation cut by the token budget while still on
    the right text, or one that leaves it inside a multi-byte character, is skipped."""
    from ds4lib.engine.engine import EOS
    generated, answer = [int(t) for t in generated], [int(t) for t in answer]
    if generated == answer:
        return _Verdict(None)
    want = _text(engine, answer[:-1] if answer and answer[-1] == EOS else answer)
    j = None
    for k, t in enumerate(generated):
        if t == EOS:
            if _text(engine, generated[:k]) == want:
                return _Verdict(None)             # the right text in other tokens, then the end
            j = k
            break
        if not want.startswith(_text(engine, generated[:k + 1]).rstrip("\ufffd")):
            j = k
            break
    if j is None:
        return _Verdict(len(generated), skip="the generation stopped (token budget: the right answer's length) while "
                                             "still spelling the right text with other tokens")
    if generated[:j] == answer[:j]:
        a = answer[j]
    else:
        done = _text(engine, generated[:j])
        if not want.startswith(done):
            return _Verdict(j, skip=f"the generation leaves the right text inside a character at index {j}")
        rest = want[len(done):]
        a = enc.encode_pieces([(rest, False)])[0] if rest else EOS
    if a == generated[j]:
        return _Verdict(j, skip=f"the right token at index {j} cannot be told from the one the model wrote")
    return _Verdict(j, a=int(a))


def _first_rows(meta) -> np.ndarray:
    """[N] bool: the first row of each position's group (a against its strongest rival)."""
    g = meta.group
    return np.r_[True, g[1:] != g[:-1]] if len(g) else np.zeros(0, bool)


def _capture(engine, it: _Item, norm: str, rivals: int):
    """Rows of one request that is right (constraint rows on every generated position) or wrong (its decision point
    and constraint rows before it), `rivals` rows per position, checked to reproduce the generation."""
    from ds4lib.formats.names import HEAD, NORM
    from ds4lib.posttrain.capture import _check_engine, _global, capture_positions, rows_from_capture
    _check_engine(engine)
    P = len(it.prompt_ids)
    gen = it.generated if it.j is None else it.generated[:it.j + 1]
    points = [] if it.j is None else [(P + it.j, it.a)]
    it.cap = capture_positions(engine, it.prompt_ids, gen)       # capture_rows, keeping the capture
    prob, meta = rows_from_capture(it.cap, points, head=_global(engine, HEAD), norm_weight=_global(engine, NORM),
                                   norm_eps=engine.cfg.norm_eps, cfg=engine.cfg, norm=norm, rivals=rivals,
                                   sidecar_fnv=engine.sidecar.fingerprint if engine.sidecar is not None else None)
    # the capture must reproduce the generation: top-1 = the written token on each constraint position; on the
    # decision point the strongest token other than the right one is the one the model wrote
    first = _first_rows(meta)
    want = np.asarray(gen, np.int64)[meta.row[first]]
    got = np.where(meta.kind, meta.b, meta.a)[first]
    if not np.array_equal(got, want):
        i = int(np.nonzero(first)[0][np.nonzero(got != want)[0][0]])
        got, want = np.where(meta.kind, meta.b, meta.a), np.asarray(gen, np.int64)[meta.row]
        raise PosttrainError(f"{_label(it.req)}: the capture does not reproduce the generation at position "
                             f"{int(meta.positions[i])} (top token {int(got[i])}, generation wrote {int(want[i])})")
    return prob, meta


# ---------------------------------------------------------------------------------------------------- writing
def _write_candidate(path: Path, cfg, layer: int, sol, sidecar, notes: dict) -> str:
    """A ③ directory at `path` (which must not exist) holding exactly the solver's lattice blocks; read back and
    checked. Returns its fingerprint."""
    from ds4lib.formats.sidecar import read_sidecar, write_layer_files, write_manifest
    path.mkdir(parents=True)
    write_layer_files(path, cfg, layer, gain_blocks=sol.blocks)
    (path / "base.fnv").write_text(sidecar.fingerprint + "\n")
    write_manifest(path, cfg, kind="posttrain", layers={layer: {"gains": True, "bias": False}}, notes=notes)
    back = read_sidecar(path, cfg, expect_kind="posttrain")
    if not np.array_equal(back.gains.get(layer), sol.gains) or back.base_fnv != sidecar.fingerprint:
        raise PosttrainError(f"{path}: the written directory does not read back as the solved gains")
    return back.fingerprint


def _write_report(path: Path, rep: PosttrainReport) -> None:
    tmp = path / (REPORT + ".partial")
    tmp.write_text(json.dumps(rep.as_dict(), indent=1) + "\n")
    os.replace(tmp, path / REPORT)


def _rejected_dir(out: Path) -> Path:
    folder = out.parent / "rejected"
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    name, k = f"{out.name}-{stamp}", 1
    while (folder / name).exists() or (folder / (name + ".partial")).exists():
        k += 1
        name = f"{out.name}-{stamp}-{k}"
    return folder / name


def _install(tmp: Path, out: Path) -> None:
    """Rename the finished `tmp` to `out`, keeping a previous `out` as `<out>.old` (ds4lib.formats.sidecar's rule:
    the copy older than that is removed only once the new directory is in place)."""
    from ds4lib.formats.sidecar import _swap_into_place
    _swap_into_place(tmp, out)


# ---------------------------------------------------------------------------------------------------- verification
def _corr(x, y) -> float:
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    if len(x) < 2 or np.std(x) == 0 or np.std(y) == 0:
        return float("nan")
    return float(np.corrcoef(x, y)[0, 1])


def _verify(engine, judge, items, problem, sol, progress: bool) -> dict:
    """Re-capture every request's rows on `engine` (② + the candidate ③) and generate every request again."""
    from ds4lib.posttrain.capture import capture_positions
    from ds4lib.solvers.margins import group_kinds, matvec
    N = len(problem.m)
    real_m = np.empty(N)
    top1 = np.empty(N, np.int64)
    for it in _progress(items, progress, "verify"):
        it.after = _greedy(engine, it.prompt_ids, len(it.answer_ids))
        it.after_j = judge(it.after, it.answer_ids).j
        meta = it.meta
        if meta is None:                      # a skipped request: no rows
            continue
        gen = it.generated if it.j is None else it.generated[:it.j + 1]
        cap = capture_positions(engine, it.prompt_ids, gen)
        lg = cap.logits[meta.row]
        idx = np.arange(len(meta.row))
        real_m[it.rows] = lg[idx, meta.a].astype(np.float64) - lg[idx, meta.b].astype(np.float64)
        top1[it.rows] = lg.argmax(-1)
    dec = problem.kind
    a = np.concatenate([it.meta.a for it in items if it.meta is not None])
    first = np.concatenate([_first_rows(it.meta) for it in items if it.meta is not None])
    above = np.bincount(problem.group, weights=(real_m <= 0).astype(np.float64)) == 0       # [positions]
    gdec = group_kinds(problem)
    predicted_change = matvec(problem, sol.delta)
    real_change = real_m - problem.m
    err = real_change - predicted_change
    top = float(np.abs(predicted_change).max()) if N else 0.0
    n_dec, n_con = int(gdec.sum()), int((~gdec).sum())
    flipped = int((top1[dec & first] == a[dec & first]).sum())      # a is the real top-1 of the position
    kept = int((top1[~dec & first] == a[~dec & first]).sum())
    right_after = [it for it in items if it.after_j is None]
    broken = [it for it in items if it.j is None and it.after_j is not None]
    return {
        "flipped": flipped, "flipped_share": flipped / n_dec if n_dec else 0.0,
        "flipped_pair": int(above[gdec].sum()),        # a above each of its captured rivals
        "reached_tau": None,                      # filled by the caller (needs τ)
        "kept": kept, "kept_share": kept / n_con if n_con else 1.0,
        "kept_pair": int(above[~gdec].sum()),
        "corr_change": _corr(predicted_change, real_change), "corr_margin": _corr(sol.margins, real_m),
        "max_abs_err": float(np.abs(err).max()) if N else 0.0,
        "rms_rel_err": float(np.linalg.norm(err) / np.linalg.norm(predicted_change)) if top > 0 else 0.0,
        "answers_right": len(right_after), "answers_broken": [it.req.id for it in broken],
        "margins": real_m, "top1": top1,
    }


def _progress(items, on: bool, what: str):
    if not on:
        return items
    from tqdm.auto import tqdm
    return tqdm(items, desc=f"ds4 posttrain: {what}", unit="request")


# ---------------------------------------------------------------------------------------------------- the solve
@dataclass
class RequestRows:
    """The margin rows of a day of requests (collect_rows): the stacked MarginProblem and what led to it."""
    items: list                       # [_Item] per request: tokens, generation, decision point, its rows
    wrong: list                       # the items with a decision point
    skipped: list                     # the items that give no rows (_judge)
    problem: object                   # MarginProblem of the last backbone MoE layer, every request's rows stacked
    layer: int
    generate_seconds: float
    capture_seconds: float


def collect_rows(engine, requests, *, norm: str = "linear", rivals: int = RIVALS,
                 progress: bool = False) -> RequestRows:
    """Greedy answers, decision points and margin rows (module docstring) of `requests` ([Request]) on `engine`
    (the ② stack, no ③ mounted). Raises NoDecisionPoints when no request has one."""
    from ds4lib.solvers.margins import stack_problems
    from ds4lib.tokenizer import TextEncoder
    enc = TextEncoder(engine.tokenizer)
    items = _tokenise(engine, enc, requests)
    t0 = time.perf_counter()
    for it in _progress(items, progress, "generate"):
        it.generated = _greedy(engine, it.prompt_ids, len(it.answer_ids))
        v = _judge(engine, enc, it.generated, it.answer_ids)
        it.j, it.a, it.skip = v.j, v.a, v.skip
    generate_seconds = time.perf_counter() - t0
    wrong = [it for it in items if it.j is not None and not it.skip]
    skipped = [it for it in items if it.skip]
    if not wrong and not skipped:
        raise NoDecisionPoints(f"all {len(items)} answers are already right (the model's greedy output is the right "
                               f"answer on every request): no decision point, nothing written")
    if not wrong:
        raise NoDecisionPoints(f"no decision point: {len(items) - len(skipped)} of {len(items)} answers are already "
                               f"right and {len(skipped)} skipped (first: {_label(skipped[0].req)}: "
                               f"{skipped[0].skip}); nothing written")

    t0 = time.perf_counter()
    probs, n = [], 0
    for it in _progress(items, progress, "capture"):
        if it.skip:
            it.rows = slice(n, n)
            continue
        prob, it.meta = _capture(engine, it, norm, rivals)
        it.rows = slice(n, n + len(prob.m))
        n += len(prob.m)
        probs.append(prob)
    capture_seconds = time.perf_counter() - t0
    layer = wrong[0].meta.layer
    problem = stack_problems(probs)                   # positions numbered across requests
    return RequestRows(items=items, wrong=wrong, skipped=skipped, problem=problem, layer=layer,
                       generate_seconds=generate_seconds, capture_seconds=capture_seconds)


def _keep(engine, positions: int, slices, rivals: int, norm: str, progress: bool):
    """The ordinary-text rows (KeepRows) or None when positions is 0."""
    from ds4lib.posttrain.keep import keep_rows
    if not positions:
        return None
    mapping = isinstance(slices, dict)
    try:
        return keep_rows(engine, positions=positions, slices=None if mapping else slices,
                         windows=slices if mapping else None, rivals=rivals, norm=norm, progress=progress)
    except ValueError as e:
        raise PosttrainError(f"ordinary text: {e}") from None


def _day_solution(sol, full, n_day: int, tau: float):
    """The solution seen on the day's rows (the first n_day of `full`): margins, weights and counts of the day's own
    positions (the gates)."""
    import dataclasses

    from ds4lib.solvers.margins import group_kinds
    ok = np.bincount(full.group, weights=(sol.margins <= 0).astype(np.float64)) == 0            # [positions]
    at_tau = np.bincount(full.group, weights=(sol.margins < tau).astype(np.float64)) == 0
    gk = group_kinds(full)
    n_groups = int(full.group[n_day - 1]) + 1 if n_day else 0
    day = np.arange(len(ok)) < n_groups
    flipped, kept = int(ok[day & gk].sum()), int(ok[day & ~gk].sum())
    n_dec, n_con = int((day & gk).sum()), int((day & ~gk).sum())
    return dataclasses.replace(sol, margins=sol.margins[:n_day], float_margins=sol.float_margins[:n_day],
                              weights=sol.weights[:n_day], held=sol.held[:n_day], flipped=flipped,
                              flipped_share=flipped / n_dec if n_dec else 0.0,
                              reached_tau=int(at_tau[day & gk].sum()), kept=kept,
                              kept_share=kept / n_con if n_con else 1.0, n_decisions=n_dec, n_constraints=n_con)


def _solve_with_rivals(engine, items, full, passes: int, norm: str, solve):
    """solve(full), then up to `passes` rival passes (ds4lib.posttrain.rivals): tokens outside a day position's rows
    that the solved δ brings within RIVAL_MARGIN of its token become rows of that position (its group, appended
    after every other row, so the day's own rows keep their indices) and the problem is solved again. Returns
    (the problem solved last, its solution, rows added per pass)."""
    from ds4lib.formats.names import HEAD, NORM
    from ds4lib.posttrain.capture import _global, pair_coefficients
    from ds4lib.posttrain.rivals import rival_pairs
    from ds4lib.solvers.margins import make_problem
    head, gamma = _global(engine, HEAD), _global(engine, NORM)
    sol, added, taken = solve(full), [], {}
    for _ in range(passes):
        parts = []
        for it in items:
            if it.meta is None or it.rows.stop == it.rows.start:
                continue
            off = int(full.group[it.rows.start]) - int(it.meta.group[0])          # the request's first group
            seen = taken.setdefault(id(it), {})
            row, a, b, kind, grp = rival_pairs(it.cap, it.meta, seen, sol.delta, head=head, norm_weight=gamma)
            if len(row):
                R, m, _, _, _ = pair_coefficients(it.cap, row, a, b, head=head, norm_weight=gamma,
                                                  norm_eps=engine.cfg.norm_eps, norm=norm)
                parts.append((it.cap.ids[row], R, m, kind, grp + off))
        added.append(sum(len(x[2]) for x in parts))
        if not parts:
            break
        cat = {f: np.concatenate([getattr(full, f)] + [x[i] for x in parts])
               for i, f in enumerate(("ids", "R", "m", "kind", "group"))}
        full = make_problem(**cat, n_experts=full.n_experts)
        sol = solve(full)
    return full, sol, added


def _judge_gate(open_engine, candidate, base: Path, engine, slices, max_drop: float, original, cache_dir) -> dict:
    from ds4lib.config import Env
    from ds4lib.posttrain.judge import judge_candidate
    from ds4lib.quant import file_sha256
    try:
        return judge_candidate(open_engine=open_engine, candidate=candidate,
                               slices=slices if isinstance(slices, dict) else list(slices), max_drop=max_drop,
                               original=original, cache_dir=cache_dir or Env.read().cache_dir,
                               base_key=f"{file_sha256(base)[:16]}-{engine.sidecar.fingerprint}")
    except ValueError as e:
        raise PosttrainError(f"judging slices: {e}") from None


def solve_posttrain(*, base, zchain, requests, out, engram_dir=None, tau: float = TAU, rho: float = RHO,
                    lam: float = LAM, kappa: float = KAPPA, rivals: int = RIVALS, rounds: int = ROUNDS,
                    min_flip: float = MIN_FLIP, min_kept: float = MIN_KEPT, norm: str = "linear",
                    backend: str = "cpu", tokenizer=None, prefill_block: int = 512, verify: bool = True,
                    keep_positions: int = KEEP_POSITIONS, keep_slices=None, keep_rivals: int = KEEP_RIVALS,
                    keep_rho: float = KEEP_RHO, keep_as_rows: bool = False, rival_passes: int = RIVAL_PASSES,
                    judge_slices=(), max_top1_drop: float = MAX_TOP1_DROP, original=None, cache_dir=None,
                    progress: bool = False) -> PosttrainReport:
    """Solve a ③ post-training directory for the ① `base` + ② `zchain` stack from `requests` (a JSON-lines path,
    or an iterable of Request / {"id", "prompt", "answer"} dicts) and write it to `out` if it passes the gates,
    else to `<out parent>/rejected/<out name>-<timestamp>/` (module docstring). `verify` (installed candidates
    only) measures the real numbers before the rename. `keep_positions` ordinary-text positions (from `keep_slices`,
    names or {name: token windows}; default the sidecar's fit slices and english/fit; 0: none) give "keep top-1" rows with
    `keep_rivals` rivals each, which weigh the ridge per gain with `keep_rho` (ordinary_ridge), or with
    `keep_as_rows` join the solve as constraint rows of weight ρ. `judge_slices` (default none: two minutes a slice) gates a verified
    candidate on Same top-1 against ② alone there (ds4lib.posttrain.judge; teacher `original`, default the Engram
    directory; ② numbers cached under `cache_dir`, default the Env's). Raises PosttrainError / NoDecisionPoints on
    input it refuses; CaptureError if the capture does not reproduce the engine's own MoE output."""
    from ds4lib.engine import Engine, EngineError
    from ds4lib.formats.sidecar import SidecarError
    from ds4lib.posttrain.capture import NORM_MODES
    from ds4lib.solvers.margins import group_kinds, ordinary_ridge, predict, solve_margins, stack_problems
    from ds4lib.tokenizer import TextEncoder

    for name, v in (("tau", tau), ("rho", rho), ("lam", lam), ("kappa", kappa), ("min_flip", min_flip),
                    ("min_kept", min_kept), ("max_top1_drop", max_top1_drop), ("keep_rho", keep_rho)):
        positive = name in ("tau", "lam")
        if (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0
                or (positive and v == 0)):
            raise PosttrainError(f"{name} must be a finite number {'> 0' if positive else '≥ 0'}, got {v!r}")
    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1:
        raise PosttrainError(f"rounds must be an integer ≥ 1, got {rounds!r}")
    for name, v, lo in (("rivals", rivals, 1), ("keep_rivals", keep_rivals, 1), ("keep_positions", keep_positions, 0),
                        ("rival_passes", rival_passes, 0)):
        if isinstance(v, bool) or not isinstance(v, int) or v < lo:
            raise PosttrainError(f"{name} must be an integer ≥ {lo}, got {v!r}")
    if norm not in NORM_MODES:
        raise PosttrainError(f"norm must be one of {', '.join(NORM_MODES)}, got {norm!r}")
    base, zchain, out = Path(base), Path(zchain), Path(out)
    cfg = _check_inputs(base, zchain, out)
    reqs, source = _as_requests(requests)

    def open_engine(posttrain=None):
        try:
            return Engine(base, zchain=zchain, posttrain=posttrain, engram_dir=engram_dir, backend=backend,
                          prefill_block=prefill_block, tokenizer_path=tokenizer)
        except (EngineError, SidecarError) as e:
            raise PosttrainError(str(e)) from None

    engine = open_engine()
    enc = TextEncoder(engine.tokenizer)

    def judge(generated, answer):
        return _judge(engine, enc, generated, answer)

    rows = collect_rows(engine, reqs, norm=norm, rivals=rivals, progress=progress)
    items, wrong, skipped, problem, layer = rows.items, rows.wrong, rows.skipped, rows.problem, rows.layer
    generate_seconds, capture_seconds = rows.generate_seconds, rows.capture_seconds
    keep = _keep(engine, keep_positions, keep_slices, keep_rivals, norm, progress)

    t0 = time.perf_counter()
    full = problem if keep is None or not keep_as_rows else stack_problems([problem, keep.problem])
    ridge = None if keep is None or keep_as_rows else ordinary_ridge(keep.problem, lam, keep_rho)
    full, sol, added = _solve_with_rivals(engine, items, full, rival_passes, norm,
                                          lambda q: solve_margins(q, tau, rho, lam, kappa=kappa, rounds=rounds,
                                                                  ridge=ridge))
    sol = _day_solution(sol, full, len(problem.m), tau)
    solve_seconds = time.perf_counter() - t0
    ordinary = {"positions": 0, "kept": 0, "rows": 0}
    if keep is not None:
        ok = np.bincount(keep.problem.group, weights=(predict(keep.problem, sol.delta) <= 0).astype(np.float64)) == 0
        ordinary = {"positions": len(ok), "kept": int(ok.sum()), "rows": len(keep.problem.m)}

    reasons = []
    if sol.flipped_share < min_flip:
        reasons.append(f"predicted flipped share {sol.flipped_share:.4f} < min_flip {min_flip:g}")
    if sol.kept_share < min_kept:
        reasons.append(f"predicted kept share {sol.kept_share:.4f} < min_kept {min_kept:g}")
    passed = not reasons
    params = {"base": str(base), "zchain": str(zchain), "zchain_fnv": engine.sidecar.fingerprint,
              "requests": source, "tau": float(tau), "rho": float(rho), "lam": float(lam), "kappa": float(kappa),
              "rivals": int(rivals), "rounds": int(rounds), "min_flip": float(min_flip),
              "min_kept": float(min_kept), "norm": norm, "backend": backend, "layer": int(layer),
              "keep_positions": int(keep_positions), "keep_rivals": int(keep_rivals), "keep_rho": float(keep_rho),
              "keep_as_rows": bool(keep_as_rows), "rival_passes": int(rival_passes), "keep_slices": None if keep is None else keep.slices, "judge_slices": list(judge_slices or ()),
              "max_top1_drop": float(max_top1_drop),
              "generation": "greedy, chat-encoded, plain decode (draft_k=0)"}
    predicted = {"flipped": sol.flipped, "flipped_share": sol.flipped_share, "reached_tau": sol.reached_tau,
                 "kept": sol.kept, "kept_share": sol.kept_share, "round": sol.round, "rows": len(problem.m),
                 "held": int(sol.held.sum()),
                 "delta_max_abs": float(np.abs(sol.delta).max()),
                 "delta_rms": float(np.sqrt(np.mean(np.square(sol.delta, dtype=np.float64)))),
                 "channels_changed": int(np.count_nonzero(sol.delta)), "solver": sol.rounds[0]["method"],
                 "ordinary_positions": ordinary["positions"], "ordinary_kept": ordinary["kept"],
                 "ordinary_rows": ordinary["rows"], "ordinary_seconds": 0.0 if keep is None else keep.seconds,
                 "rival_rows": added}
    notes = {"purpose": "ds4 posttrain", "tau": float(tau), "rho": float(rho), "lam": float(lam),
             "kappa": float(kappa), "rivals": int(rivals), "rounds": int(rounds), "norm": norm, "requests": len(items),
             "keep_positions": int(keep_positions), "keep_rivals": int(keep_rivals), "keep_rho": float(keep_rho),
             "keep_as_rows": bool(keep_as_rows), "rival_passes": int(rival_passes),
             "decision_points": sol.n_decisions,
             "constraint_rows": sol.n_constraints, "predicted_flipped_share": round(sol.flipped_share, 6),
             "predicted_kept_share": round(sol.kept_share, 6), "sidecar_fnv": engine.sidecar.fingerprint}

    rep = PosttrainReport(
        status="installed" if passed else "rejected", out=out, requested_out=out, previous=None, params=params,
        n_requests=len(items), right_before=len(items) - len(wrong) - len(skipped), skipped=len(skipped),
        decision_points=sol.n_decisions,
        constraint_rows=sol.n_constraints, predicted=predicted, cg_iterations=[r["iterations"] for r in sol.rounds],
        rounds=sol.rounds, gate={"min_flip": float(min_flip), "min_kept": float(min_kept), "passed": passed,
                                 "reasons": reasons},
        fingerprint="", base_fnv=engine.sidecar.fingerprint, solve_seconds=solve_seconds,
        generate_seconds=generate_seconds, capture_seconds=capture_seconds)
    rep.out = out if passed else _rejected_dir(out)
    if passed and out.exists():
        rep.previous = out.with_name(out.name + ".old")      # where _install keeps it
    tmp = rep.out.with_name(rep.out.name + ".partial")
    if tmp.exists():                          # a leftover of an interrupted run (the name is ours)
        shutil.rmtree(tmp)
    try:
        rep.fingerprint = _write_candidate(tmp, cfg, layer, sol, engine.sidecar, notes)
        real = None
        if passed and verify:                 # on the candidate as written, before it is renamed into place
            t0 = time.perf_counter()
            checked = open_engine(posttrain=tmp)
            if checked.posttrain is None or checked.posttrain.fingerprint != rep.fingerprint:
                raise PosttrainError(f"{tmp}: the engine did not mount the candidate")
            real = _verify(checked, judge, items, problem, sol, progress)
            low = np.bincount(problem.group, weights=(real["margins"] < tau).astype(np.float64)) > 0
            real["reached_tau"] = int((~low)[group_kinds(problem)].sum())
            rep.verify_seconds = time.perf_counter() - t0
            rep.real = {k: v for k, v in real.items() if k not in ("margins", "top1")}
            # the gates hold for the real numbers too: a candidate the linear prediction passes but a real forward
            # does not is rejected as well (never installed)
            for name, gate in (("flipped", min_flip), ("kept", min_kept)):
                if real[f"{name}_share"] < gate:
                    reasons.append(f"real {name} share {real[f'{name}_share']:.4f} < min_"
                                   f"{'flip' if name == 'flipped' else 'kept'} {gate:g}")
            if not reasons and judge_slices:      # only a candidate that passed everything else is judged
                rep.judge = _judge_gate(open_engine, tmp, base, engine, judge_slices, max_top1_drop, original,
                                        cache_dir)
                reasons += rep.judge["reasons"]
            if reasons:
                passed = False
                rep.status, rep.gate["passed"], rep.previous = "rejected", False, None
                rep.out = _rejected_dir(out)
        rep.requests = _request_rows(engine, items, sol, real)
        rep.margins = {"decision": problem.kind, "group": problem.group, "before": problem.m,
                       "predicted": sol.margins, "real": None if real is None else real["margins"]}
        _write_report(tmp, rep)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)    # nothing half-written stays behind; `out` was not touched
        raise
    if passed:
        _install(tmp, out)
    else:
        rep.out.parent.mkdir(parents=True, exist_ok=True)
        os.replace(tmp, rep.out)
    return rep


def _request_rows(engine, items, sol, real) -> list:
    dec = lambda t: engine.tokenizer.decode([int(t)], skip_special_tokens=False)   # noqa: E731
    rows = []
    for it in items:
        r = {"id": it.req.id, "line": it.req.line, "prompt_tokens": len(it.prompt_ids),
             "answer_tokens": len(it.answer_ids), "generated_tokens": len(it.generated),
             "status": "right" if it.j is None else "skipped" if it.skip else "wrong",
             "right_before": it.j is None, "rows": it.rows.stop - it.rows.start,
             "positions": 0 if it.meta is None else int(_first_rows(it.meta).sum())}
        if it.skip:
            r.update(divergence=it.j, skip=it.skip)
        elif it.j is not None:
            i = it.rows.start                     # the decision row comes first (capture_rows' order)
            a, b = int(it.meta.a[0]), int(it.meta.b[0])
            r.update(divergence=it.j, position=len(it.prompt_ids) + it.j, right_token=a, right_text=dec(a),
                     written_token=b, written_text=dec(b), margin=float(it.meta.m[0]),
                     predicted_margin=float(sol.margins[i]))
            if real is not None:
                r.update(real_margin=float(real["margins"][i]), real_top1=int(real["top1"][i]),
                         flipped=bool(real["top1"][i] == a))
        if real is not None:
            r.update(right_after=it.after_j is None, divergence_after=it.after_j)
        if real is not None and it.meta is not None:
            con = ~it.meta.kind & _first_rows(it.meta)       # one row per position
            ok = real["top1"][it.rows] == it.meta.a          # the right token is the real top-1 of the row
            bad = it.meta.positions[~ok] - len(it.prompt_ids)
            r.update(kept=int(ok[con].sum()), first_wrong_row=int(bad.min()) if len(bad) else None)
        rows.append(r)
    return rows


def format_report(rep: PosttrainReport) -> str:
    """The lines `ds4 posttrain` prints (and the notebook shows) for a report."""
    p, g = rep.predicted, rep.gate
    skipped = f", {rep.skipped} skipped" if rep.skipped else ""
    lines = [f"requests {rep.n_requests} ({rep.right_before} already right{skipped}): {rep.decision_points} decision "
             f"points, {rep.constraint_rows} other positions; {p['rows']} rows ({rep.params['rivals']} per position)",
             f"predicted: flipped {p['flipped']}/{rep.decision_points} ({100 * p['flipped_share']:.1f}%), reached τ "
             f"{p['reached_tau']}, kept {p['kept']}/{rep.constraint_rows} ({100 * p['kept_share']:.2f}%) "
             f"(lattice round {p['round']}; {p['held']} constraint rows held at κ)",
             f"solve {rep.solve_seconds:.2f} s ({p.get('solver', 'cg')}; CG iterations per round "
             f"{rep.cg_iterations}); generation {rep.generate_seconds:.1f} s, capture {rep.capture_seconds:.1f} s"]
    if p.get("ordinary_positions"):
        how = "as rows" if rep.params["keep_as_rows"] else f"weighing the ridge, ρ_o = {rep.params['keep_rho']:g}"
        lines.insert(2, f"ordinary text ({', '.join(rep.params['keep_slices'])}; {how}): predicted kept "
                        f"{p['ordinary_kept']}/{p['ordinary_positions']} positions ({p['ordinary_rows']} rows, "
                        f"captured in {p['ordinary_seconds']:.1f} s)")
    r = rep.real
    if r is not None:
        corr = "n/a" if r["corr_change"] is None else f"{r['corr_change']:.4f}"
        lines.append(f"real: flipped {r['flipped']}/{rep.decision_points} ({100 * r['flipped_share']:.1f}%; "
                     f"{r['flipped_pair']} beat their runner-up), kept {r['kept']}/{rep.constraint_rows} "
                     f"({100 * r['kept_share']:.2f}%; {r['kept_pair']} above their runner-up), answers right "
                     f"{r['answers_right']}/{rep.n_requests}, corr(predicted, real margin change) {corr} "
                     f"(verify {rep.verify_seconds:.1f} s)")
        if r["answers_broken"]:
            lines.append(f"answers right before and wrong now: {r['answers_broken']}")
    if rep.judge is not None:
        for name, j in rep.judge["slices"].items():
            lines.append(f"judge {name}: Same top-1 {100 * j['candidate']['same_top1']:.2f}% against ② alone "
                         f"{100 * j['base']['same_top1']:.2f}% ({-j['drop_pp']:+.2f} pp; gate −"
                         f"{rep.judge['max_drop_pp']:.2f} pp) {'ok' if j['passed'] else 'FAILED'}")
    if rep.installed:
        old = f"; the previous copy is {rep.previous}" if rep.previous else ""
        lines.append(f"installed {rep.out} (fingerprint {rep.fingerprint}, stacks on sidecar {rep.base_fnv}){old}")
    else:
        lines.append(f"REJECTED ({'; '.join(g['reasons'])}): written to {rep.out}, {rep.requested_out} untouched")
    return "\n".join(lines)
