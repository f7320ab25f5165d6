"""Capture for the ③ post-training solve on the deployment path (docs/design.md §4): margin rows of the last backbone
MoE layer measured where generation decides, and their check against a real forward with a ③ directory mounted.

Positions. The sequence is prompt + generated (P + G tokens). Position p is the index, in that sequence, of the token
being decided; the generated part is p ∈ [P, P+G). Position p is decided by the logits computed at index p − 1, as
generation computes them: p = P by the prompt's prefill (its last row; the engine's blocks as `prefill_block` cuts
them), every p > P by the engine's one-token decode step that fed generated[p − P − 1]. The last generated token is
never fed (it decides nothing inside the generated part). `PositionCapture.path` names the call per position.

What is observed (observer hooks of the engine's own forward, nothing recomputed), at layer l = n_layers − 1 on the
row that decides each position: routed expert ids [K] and routing weights [K], ye [K, D] (each chosen expert's
down-projection output per unit routing weight), the shared expert's output, the MoE output, the block's output
streams h [S, D], its post-mix (`block_post`, the FFN sub-layer's) and pre-mix (`block_pre`, the one the final
collapse uses), and the logits [V]. Checked at every capture: round_bf16(Σ rw·ye + ysh) reproduces the MoE output
bit for bit (ds4lib.sidecar.capture.reconstruct), and every row's margin rebuilt from the collapsed vector, the
output norm and the head agrees with the engine's logits.

Linear rows. The block's output streams are h_j = post_j·y + Σ_i comb_ij·h'_i (ds4lib.ref.hc.hc_post; y the MoE
output, h' the streams after attention), and the final collapse is z = Σ_j pre_j·h_j (hc_pre, with this block's
pre-mix, which is computed from h' and so does not depend on y). A change Δy of the MoE output therefore moves z by
α·Δy with α = Σ_j pre_j·post_j, a per-position scalar. The logits are ℓ = W·bf16(γ ⊙ z·inv), inv = 1/rms(z) (the
output norm, ds4lib.ref.norm); with inv held fixed (`norm="fixed"`, docs/design.md §4) the margin ℓ_a − ℓ_b changes
by α·inv·Σ_d γ_d (W_a − W_b)_d Δy_d. `norm="linear"` also keeps the first-order change of inv (∂inv/∂z = −inv³·z/D):
the coefficient vector becomes α·inv·(c − inv²·(c·z)/D · z) with c = γ ⊙ (W_a − W_b); still linear in δ, and exact
to first order. "linear" is the default: against a real forward with a mounted ③ of ±0.25 it predicted margin
changes with correlation ≥ 0.995 where "fixed" reached only 0.985–0.991 (tests/posttrain/test_capture.py).

Gains. The engine multiplies each routed expert's down-projection rows by g_eff = g_base · s_sidecar · s_posttrain
(ds4lib.engine.weights) before the forward, so the observed ye already carries g_base · s_sidecar: it is the
channel output of the stack that is running. A ③ gain s = 1 + δ multiplies those rows once more, so each channel's
output becomes (1 + δ[e, d]) times the observed one (up to the BF16 rounding of the expert output):

    Δy_d = Σ_k rw_k · ye_k[d] · δ[e_k, d]        (no further sidecar factor: it is inside ye)

and the rows' coefficients are R[i, k, d] = u_i[d] · rw_ik · ye_ik[d] with u_i the coefficient vector above. δ is
relative to the captured stack, so the engine must carry the ② the ③ will stack on and no ③ (a mounted ③ is
refused). `check_rows` mounts a δ as a real ③ directory and compares the real margin changes with A·δ.

Shapes: G captured positions, N rows, K active experts, D hidden, S streams, V vocab, E experts.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ds4lib.formats.names import HEAD, NORM
from ds4lib.formats.sidecar import Sidecar, dequantize_gains, quantize_gains, write_sidecar
from ds4lib.ref.hc import hc_pre
from ds4lib.ref.norm import rms_norm, rms_scale
from ds4lib.sidecar.capture import EXACT_MIN, CaptureError, reconstruct
from ds4lib.solvers.margins import MarginProblem, make_problem, matvec

__all__ = ["PositionCapture", "RowMeta", "RowCheck", "CaptureError", "capture_positions", "capture_text",
           "capture_rows",
           "rows_from_capture", "pair_coefficients", "check_rows", "NORM_MODES", "MARGIN_RTOL"]

NORM_MODES = ("fixed", "linear")
MARGIN_RTOL = 1e-3            # rebuilt margin vs the engine's: relative to |ℓ_a| + |ℓ_b| (exact on CPU: ~1e-7)
_NAMES = ("router_ids", "router_weights", "ye", "ysh", "moe_out", "block_out", "block_pre", "block_post")


@dataclass
class PositionCapture:
    """Per captured position (the generated part), float32 unless noted."""
    layer: int
    prompt_ids: np.ndarray     # [P] int64
    generated_ids: np.ndarray  # [G] int64
    positions: np.ndarray      # [G] int64: P .. P+G-1, the index of the token each row decides
    path: np.ndarray           # [G] str: "prefill" (p = P) or "decode", the call whose logits decide it
    logits: np.ndarray         # [G, V]
    ids: np.ndarray            # [G, K] int64 routed experts (descending selection score)
    weights: np.ndarray        # [G, K] routing weights
    ye: np.ndarray             # [G, K, D] per unit routing weight, stack gains included
    ysh: np.ndarray            # [G, D]
    moe_out: np.ndarray        # [G, D]
    pre: np.ndarray            # [G, S] the block's pre-mix (the final collapse's)
    post: np.ndarray           # [G, S] the FFN sub-layer's post-mix
    z: np.ndarray              # [G, D] the collapsed vector hc_pre(h, pre), as the engine's finish forms it
    alpha: np.ndarray          # [G] float64 Σ_j pre_j·post_j
    inv: np.ndarray            # [G] the output norm's factor 1/rms(z) (float32, as rms_norm computes it)
    exact: float               # share of MoE-output values reconstructed bit for bit


@dataclass
class RowMeta:
    """What a caller needs beside the MarginProblem; every array is per row [N] unless noted. Rows: the decision
    points in the order given, then the constraint rows by ascending position; each position gives `rivals`
    consecutive rows (its a against its strongest other tokens, the strongest first), one group
    (MarginProblem.group, numbered 0 .. positions − 1 in that order)."""
    layer: int
    positions: np.ndarray      # int64 position decided (sequence index)
    row: np.ndarray            # int64 index into the capture's G positions
    path: np.ndarray           # str "prefill" | "decode"
    a: np.ndarray              # int64 token that should win (decision) / the top-1 (constraint)
    b: np.ndarray              # int64 strongest other token (decision) / the top-2 (constraint)
    la: np.ndarray             # float32 captured logit of a
    lb: np.ndarray             # float32 captured logit of b
    m: np.ndarray              # float64 la − lb (= problem.m)
    kind: np.ndarray           # bool True = decision point
    alpha: np.ndarray          # float64
    inv: np.ndarray            # float32
    norm: str                  # "fixed" | "linear"
    prompt_ids: np.ndarray     # [P] int64
    generated_ids: np.ndarray  # [G] int64
    sidecar_fnv: str | None    # fingerprint of the ② the capture ran with (the ③'s base.fnv)
    n_experts: int
    cfg: object                # the model config (ds4lib.config.ModelConfig)
    margin_err: float          # max |rebuilt − engine margin| / (|ℓ_a| + |ℓ_b|) over the rows
    group: np.ndarray = None   # int64 the position's index among the captured positions (= problem.group)
    rivals: int = 1            # rows per position


@dataclass
class RowCheck:
    """A real forward with δ mounted as a ③ directory against the rows' prediction."""
    delta: np.ndarray          # [E, D] float32 the lattice δ the engine applied (gains − 1)
    predicted: np.ndarray      # [N] float64 A·δ
    real: np.ndarray           # [N] float64 real margin − captured margin
    la: np.ndarray             # [N] float32 real logits of a
    lb: np.ndarray             # [N] float32 real logits of b
    bit_identical: bool        # the real logits of every row equal the captured ones bit for bit
    corr: float                # Pearson correlation of predicted and real (nan when either is constant)
    max_rel_err: float         # max |real − predicted| / max |predicted| (0 / inf when predicted is all 0)
    rms_rel_err: float         # ‖real − predicted‖ / ‖predicted‖
    path: Path                 # the ③ directory written
    capture: PositionCapture   # the re-run capture with δ mounted


# ---------------------------------------------------------------------------------------------------- validation
def _token_list(ids, name: str, vocab: int) -> np.ndarray:
    arr = np.asarray(ids)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be a 1-D list of token ids, got shape {list(arr.shape)}")
    if len(arr) == 0:
        raise ValueError(f"{name} is empty")
    if not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"{name} must hold integer token ids, got dtype {arr.dtype}")
    bad = np.nonzero((arr < 0) | (arr >= vocab))[0]
    if len(bad):
        raise ValueError(f"{name}[{bad[0]}] = {arr[bad[0]]} is outside the vocabulary [0, {vocab})")
    return arr.astype(np.int64)


def _is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def _check_points(points, P: int, G: int, vocab: int):
    """-> positions [n], tokens [n] int64."""
    pos, tok, seen = [], [], set()
    for i, pt in enumerate(points):
        try:
            p, a = pt
        except (TypeError, ValueError):
            raise ValueError(f"decision point {i}: expected (position, token), got {pt!r}") from None
        if not _is_int(p) or not _is_int(a):
            raise ValueError(f"decision point {i}: position and token must be integers, got {pt!r}")
        if not P <= p < P + G:
            raise ValueError(f"decision point {i}: position {p} is outside the generated part [{P}, {P + G})")
        if not 0 <= a < vocab:
            raise ValueError(f"decision point {i}: token {a} is outside the vocabulary [0, {vocab})")
        if int(p) in seen:
            raise ValueError(f"decision point {i}: position {p} is given twice")
        seen.add(int(p))
        pos.append(int(p))
        tok.append(int(a))
    return np.asarray(pos, np.int64), np.asarray(tok, np.int64)


def _check_constraints(constraints, decisions, P: int, G: int) -> np.ndarray:
    if constraints is None:
        return np.setdiff1d(np.arange(P, P + G, dtype=np.int64), decisions)
    out, dec = set(), set(np.asarray(decisions).tolist())
    for p in constraints:
        if not _is_int(p):
            raise ValueError(f"constraint positions must be integers, got {p!r}")
        if not P <= p < P + G:
            raise ValueError(f"constraint position {p} is outside the generated part [{P}, {P + G})")
        if int(p) in dec:
            raise ValueError(f"constraint position {p} is also a decision point")
        if int(p) in out:
            raise ValueError(f"constraint position {p} is given twice")
        out.add(int(p))
    return np.asarray(sorted(out), np.int64)


# ---------------------------------------------------------------------------------------------------- capture
def _global(engine, name):
    """A global tensor as the engine holds it (the CPU backend's cache; else the base file's decoded value)."""
    w = getattr(engine.backend, "weights", None)
    if w is not None and hasattr(w, "global_"):
        return np.asarray(w.global_(name), np.float32)
    return np.asarray(engine.base.tensor(name), np.float32)


def capture_positions(engine, prompt_ids, generated_ids) -> PositionCapture:
    """Prefill `prompt_ids`, then feed generated_ids[:-1] one token at a time through the decode path, observing the
    last backbone layer on the row that decides each generated position. Raises ValueError on bad input,
    CaptureError when the observations do not reproduce the engine's MoE output."""
    cfg = engine.cfg
    V = cfg.vocab_size
    prompt = _token_list(prompt_ids, "prompt_ids", V)
    gen = _token_list(generated_ids, "generated_ids", V)
    P, G = len(prompt), len(gen)
    if P + G - 1 > engine.context_length:
        raise ValueError(f"prompt and generated part need {P + G - 1} positions; the model's context is "
                         f"{engine.context_length}")
    layer = cfg.n_layers - 1
    cur: dict = {}

    def observe(l, name, value):
        if l == layer and name in _NAMES:
            cur[name] = np.array(value[-1])         # the call's last row: the one that decides the next token

    got = {n: [] for n in _NAMES}
    logits = []

    def take(lg):
        missing = [n for n in _NAMES if n not in cur]
        if missing:
            raise CaptureError(f"layer {layer}: the {engine.backend.name} backend reported no "
                               f"{', '.join(missing)}")
        for n in _NAMES:
            got[n].append(cur[n])
        logits.append(np.asarray(engine.backend.to_host(lg), np.float32).reshape(-1))
        cur.clear()

    sess = engine.new_session()               # never the prefix cache: its prefill would skip the observed rows
    take(engine.prefill(sess, prompt.tolist(), observer=observe))
    for t in gen[:-1]:
        take(engine.decode(sess, int(t), observer=observe))
    cat = {n: np.stack(v) for n, v in got.items()}
    return _position_capture(cfg, layer, cat, np.stack(logits), prompt, gen,
                             np.array(["prefill"] + ["decode"] * (G - 1)))


def capture_text(engine, tokens) -> PositionCapture:
    """Ordinary text teacher-forced: `tokens` (BOS first, as the evaluation scores a window) through the engine's
    prefill in one pass (its `prefill_block` blocks), observing the last backbone layer on every row; row t decides
    position t + 1. The same observations and checks as capture_positions, on the prefill path only: prompt_ids =
    tokens[:1], generated_ids = tokens[1:], every path "prefill". What the ③'s "keep top-1" rows of ordinary text
    are built from (rows_from_capture with no decision points)."""
    cfg = engine.cfg
    seq = _token_list(tokens, "tokens", cfg.vocab_size)
    if len(seq) < 2:
        raise ValueError(f"tokens must hold at least 2 ids (BOS and one position), got {len(seq)}")
    if len(seq) - 1 > engine.context_length:
        raise ValueError(f"{len(seq) - 1} positions; the model's context is {engine.context_length}")
    layer = cfg.n_layers - 1
    got = {n: [] for n in _NAMES}

    def observe(l, name, value):
        if l == layer and name in _NAMES:
            got[name].append(np.array(value))       # every row of the block

    lg = np.asarray(engine.backend.to_host(engine.logits(seq[:-1].tolist(), observer=observe)), np.float32)
    missing = [n for n in _NAMES if not got[n]]
    if missing:
        raise CaptureError(f"layer {layer}: the {engine.backend.name} backend reported no {', '.join(missing)}")
    cat = {n: np.concatenate(v) for n, v in got.items()}
    return _position_capture(cfg, layer, cat, lg.reshape(len(seq) - 1, -1), seq[:1], seq[1:],
                             np.array(["prefill"] * (len(seq) - 1)))


def _position_capture(cfg, layer, cat, logits, prompt, gen, path) -> PositionCapture:
    """The observations of the rows that decide gen's positions -> PositionCapture, checked (module docstring)."""
    P, G = len(prompt), len(gen)
    ids = cat["router_ids"].astype(np.int64)
    w = cat["router_weights"].astype(np.float32)
    ye = cat["ye"].astype(np.float32)
    ysh = cat["ysh"].astype(np.float32)
    out = cat["moe_out"].astype(np.float32)
    if len(ids) != G or len(logits) != G:
        raise CaptureError(f"layer {layer}: {len(ids)} observed rows and {len(logits)} logit rows for {G} positions")
    exact = float((reconstruct(ids, w, ye, ysh).view(np.uint32) == out.view(np.uint32)).mean())
    if exact < EXACT_MIN:
        raise CaptureError(f"layer {layer}: round_bf16(Σ rw·ye + ysh) equals the engine's MoE output on only "
                           f"{100 * exact:.4f}% of values (need ≥ {100 * EXACT_MIN:.2f}%)")
    pre = cat["block_pre"].astype(np.float32)
    post = cat["block_post"].astype(np.float32)
    z = hc_pre(cat["block_out"].astype(np.float32), pre)                      # finish's collapse, row by row
    inv = rms_scale(z, cfg.norm_eps)[:, 0]
    alpha = np.einsum("gs,gs->g", pre.astype(np.float64), post.astype(np.float64))
    return PositionCapture(layer=layer, prompt_ids=prompt, generated_ids=gen,
                           positions=np.arange(P, P + G, dtype=np.int64), path=path, logits=logits,
                           ids=ids, weights=w, ye=ye, ysh=ysh, moe_out=out, pre=pre, post=post, z=z,
                           alpha=alpha, inv=inv, exact=exact)


def _other_top(lg, exclude, n: int = 1) -> np.ndarray:
    """The n highest columns of each row of lg [n_rows, V] with column exclude[i] left out, highest first (ties to
    the lower id) -> [n_rows, n]."""
    x = lg.copy()
    x[np.arange(len(x)), exclude] = -np.inf
    return np.argsort(-x, axis=-1, kind="stable")[:, :n]


def _check_rivals(rivals, V: int) -> int:
    if isinstance(rivals, bool) or not isinstance(rivals, (int, np.integer)) or not 1 <= rivals < V:
        raise ValueError(f"rivals must be an integer in [1, {V - 1}] (other tokens per position), got {rivals!r}")
    return int(rivals)


def pair_coefficients(cap: PositionCapture, row, a, b, *, head, norm_weight, norm_eps: float,
                      norm: str = "linear"):
    """The linear rows of (token a over token b) at captured positions `row` (indices into cap's G positions), as
    rows_from_capture builds them (module docstring "Linear rows"): (R [N, K, D], m [N] = ℓ_a − ℓ_b, la [N], lb [N],
    margin_err). Raises CaptureError when a margin rebuilt from the collapsed vector departs from the engine's."""
    P = len(cap.prompt_ids)
    lg = cap.logits
    la, lb = lg[row, a], lg[row, b]
    m = la.astype(np.float64) - lb.astype(np.float64)

    # coefficient vector per row: u = α·inv·c (fixed) or α·inv·(c − inv²·(c·z)/D · z) (linear)
    W = np.asarray(head, np.float64)
    gamma = np.asarray(norm_weight, np.float64)
    c = gamma * (W[a] - W[b])                                                           # [N, D]
    z = cap.z[row].astype(np.float64)
    inv = cap.inv[row].astype(np.float64)
    alpha = cap.alpha[row]
    D = z.shape[1]
    # the margin rebuilt from the collapsed vector, as the engine forms it: W·bf16(γ ⊙ z·inv)
    normed = rms_norm(cap.z[row], norm_weight, norm_eps).astype(np.float64)
    rebuilt = np.einsum("nd,nd->n", W[a] - W[b], normed)
    scale = np.abs(la).astype(np.float64) + np.abs(lb) + 1e-30
    margin_err = float((np.abs(rebuilt - m) / scale).max()) if len(m) else 0.0
    if margin_err > MARGIN_RTOL:
        i = int(np.argmax(np.abs(rebuilt - m) / scale))
        raise CaptureError(f"row {i} (position {P + row[i]}): the margin rebuilt from the collapsed vector, "
                           f"{rebuilt[i]:.6g}, differs from the engine's {m[i]:.6g} (relative {margin_err:.2e} > "
                           f"{MARGIN_RTOL})")
    u = c
    if norm == "linear":
        u = c - (inv ** 2 * np.einsum("nd,nd->n", c, z) / D)[:, None] * z
    u = (alpha * inv)[:, None] * u
    R = u[:, None, :] * (cap.weights[row].astype(np.float64)[:, :, None] * cap.ye[row].astype(np.float64))
    return R, m, la, lb, margin_err


def rows_from_capture(cap: PositionCapture, points, *, head, norm_weight, norm_eps: float, cfg, constraints=None,
                      norm: str = "linear", sidecar_fnv=None, rivals: int = 1):
    """The margin rows of a capture (capture_rows without running the engine): (MarginProblem, RowMeta). head [V, D]
    and norm_weight [D] as the engine holds them; cfg the model config."""
    n_experts = cfg.moe_shape(cap.layer)[0]
    if norm not in NORM_MODES:
        raise ValueError(f"norm must be one of {', '.join(NORM_MODES)}, got {norm!r}")
    P, G = len(cap.prompt_ids), len(cap.generated_ids)
    V = cap.logits.shape[1]
    M = _check_rivals(rivals, V)
    dpos, da = _check_points(points, P, G, V)
    cpos = _check_constraints(constraints, dpos, P, G)
    drow, crow = dpos - P, cpos - P
    lg = cap.logits
    db = _other_top(lg[drow], da, M)                                                    # [nd, M]
    ct1 = lg[crow].argmax(-1)
    ct2 = _other_top(lg[crow], ct1, M)                                                  # [nc, M]
    row = np.repeat(np.concatenate([drow, crow]), M)
    a = np.repeat(np.concatenate([da, ct1]), M).astype(np.int64)
    b = np.concatenate([db, ct2]).reshape(-1).astype(np.int64)
    kind = np.repeat(np.arange(len(drow) + len(crow)) < len(drow), M)
    group = np.repeat(np.arange(len(drow) + len(crow), dtype=np.int64), M)
    R, m, la, lb, margin_err = pair_coefficients(cap, row, a, b, head=head, norm_weight=norm_weight,
                                                 norm_eps=norm_eps, norm=norm)
    problem = make_problem(ids=cap.ids[row], R=R, m=m, kind=kind, n_experts=n_experts, group=group)
    meta = RowMeta(layer=cap.layer, positions=P + row, row=row, path=cap.path[row], a=a, b=b, la=la, lb=lb, m=m,
                   kind=kind, alpha=cap.alpha[row], inv=cap.inv[row], norm=norm, prompt_ids=cap.prompt_ids,
                   generated_ids=cap.generated_ids, sidecar_fnv=sidecar_fnv, n_experts=n_experts, cfg=cfg,
                   margin_err=margin_err, group=group, rivals=M)
    return problem, meta


def _check_engine(engine):
    if engine.posttrain is not None:
        raise ValueError("the engine already has a post-training file mounted; capture on the ② stack the ③ will "
                         "stack on (δ is relative to the captured stack)")


def capture_rows(engine, prompt_ids, generated_ids, points, *, constraints=None, norm: str = "linear",
                 rivals: int = 1):
    """Margin rows of the last backbone MoE layer -> (MarginProblem, RowMeta).

    points: (position, a) decision points, position in the generated part [P, P+G) (module docstring), a the token
    that should win; b is the highest-logit token other than a, m = ℓ_a − ℓ_b. constraints: None (every other
    generated position) or the positions to keep; their rows have (a, b) = (top-1, top-2), m = top-1 − top-2 ≥ 0.
    norm: "fixed" (inv held fixed, docs/design.md §4) or "linear" (inv's first-order change included). rivals: rows
    per position, a against each of its `rivals` strongest other tokens (b above is the first of them)."""
    _check_engine(engine)
    if norm not in NORM_MODES:
        raise ValueError(f"norm must be one of {', '.join(NORM_MODES)}, got {norm!r}")
    cfg = engine.cfg
    V = cfg.vocab_size
    P = len(_token_list(prompt_ids, "prompt_ids", V))
    G = len(_token_list(generated_ids, "generated_ids", V))
    points = list(points)
    constraints = None if constraints is None else list(constraints)
    _check_constraints(constraints, _check_points(points, P, G, V)[0], P, G)   # bad input fails before the forward
    _check_rivals(rivals, V)
    cap = capture_positions(engine, prompt_ids, generated_ids)
    sc = engine.sidecar
    return rows_from_capture(cap, points, head=_global(engine, HEAD), norm_weight=_global(engine, NORM),
                             norm_eps=cfg.norm_eps, constraints=constraints, norm=norm, cfg=cfg,
                             sidecar_fnv=sc.fingerprint if sc is not None else None, rivals=rivals)


# ---------------------------------------------------------------------------------------------------- check
def _corr(x, y) -> float:
    if len(x) < 2 or np.std(x) == 0 or np.std(y) == 0:
        return float("nan")
    return float(np.corrcoef(x, y)[0, 1])


def check_rows(engine_factory, problem: MarginProblem, meta: RowMeta, delta, workdir) -> RowCheck:
    """Mount δ [E, D] (gains 1 + δ on the rows' layer) as a real ③ directory `workdir/posttrain_check` (written with
    ds4lib.formats.sidecar, kind "posttrain", base.fnv = the captured ②'s fingerprint), build the engine with
    `engine_factory(posttrain=path)` (same base and ② as the capture), re-run the same capture and compare each
    row's real margin change (same (a, b) pair) with the predicted A·δ. δ is put on the FP4 lattice as the writer
    stores it; the prediction uses that lattice δ, exactly what the engine applies."""
    if meta.sidecar_fnv is None:
        raise ValueError("the capture ran without a ② sidecar; a ③ post-training file stacks on one (pass zchain)")
    D = problem.R.shape[2]
    delta = np.asarray(delta, np.float32)
    if delta.shape != (problem.n_experts, D):
        raise ValueError(f"delta must be [E, D] = [{problem.n_experts}, {D}], got {list(delta.shape)}")
    if not np.isfinite(delta).all():
        raise ValueError("delta has non-finite values")
    lattice = dequantize_gains(quantize_gains(delta)) - np.float32(1.0)
    predicted = matvec(problem, lattice)
    path = Path(workdir) / "posttrain_check"
    write_sidecar(path, meta.cfg, kind="posttrain", gain_deltas={meta.layer: lattice},
                  base=Sidecar(kind="sidecar", fingerprint=meta.sidecar_fnv),
                  notes={"purpose": "ds4lib.posttrain.check_rows"})
    engine = engine_factory(posttrain=path)
    if engine.posttrain is None:
        raise ValueError("engine_factory(posttrain=path) did not mount the post-training directory")
    cap = capture_positions(engine, meta.prompt_ids, meta.generated_ids)
    la, lb = cap.logits[meta.row, meta.a], cap.logits[meta.row, meta.b]
    real = (la.astype(np.float64) - lb.astype(np.float64)) - meta.m
    same = bool(np.array_equal(la.view(np.uint32), meta.la.view(np.uint32))
                and np.array_equal(lb.view(np.uint32), meta.lb.view(np.uint32)))
    err = np.abs(real - predicted)
    top = float(np.abs(predicted).max()) if len(predicted) else 0.0
    if top > 0:
        max_rel, rms_rel = float(err.max() / top), float(np.linalg.norm(real - predicted) / np.linalg.norm(predicted))
    else:
        max_rel = rms_rel = 0.0 if not err.any() else float("inf")
    return RowCheck(delta=lattice, predicted=predicted, real=real, la=la, lb=lb, bit_identical=same,
                    corr=_corr(predicted, real), max_rel_err=max_rel, rms_rel_err=rms_rel, path=path, capture=cap)
