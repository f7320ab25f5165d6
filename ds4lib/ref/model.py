"""The full-precision reference forward of DeepSeek V4.1 (docs/architecture.md §10): the teacher and the spec.

`ReferenceModel.load(dir)` opens an official-format checkpoint; `logits(ids)` gives teacher-forced
FP32 logits [T, V]; `forward(ids, state)` runs one chunk at the state's position (prefill, chunked
prefill or one-token decode: the same code, docs/architecture.md §1.1, erratum E2), `forward_rows` one token of
each of several sessions, and the DSpark calls draft blocks. Dtype boundaries follow the official code (BF16 state
and linear outputs, FP32 mixes, accumulations and logits); the activation quantise-dequantise of
docs/architecture.md §11.3 is on unless `quant_sim=False`.

Observation points: pass `observer(layer, name, value)`; it receives block_in, engram_out,
attn_out, moe_in, moe_out, router_scores/ids/weights, ye, ysh, block_out, block_pre, block_post (the FFN
sub-layer's post-mix [T, S]), index_scores, candidates, topk and features. With no observer nothing extra is computed.

Shapes: T tokens, S streams, D hidden, V vocab.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ds4lib.engram_geometry import engram_geometry
from ds4lib.formats.actquant import act_quant_fp4_e4m3
from ds4lib.formats.checkpoint import CheckpointReader
from ds4lib.formats.floats import round_bf16
from ds4lib.formats.names import EMBED, HEAD, NORM
from ds4lib.ref import dspark as dsp
from ds4lib.ref.attention import output_projection, query_path, sparse_attention, window_kv
from ds4lib.ref.compressor import compress
from ds4lib.ref.engram import engram_apply, engram_hashes
from ds4lib.ref.hc import hc_mixes, hc_post, hc_pre
from ds4lib.ref.indexer import candidate_blocks, index_keys, index_scores, reach, select_topk
from ds4lib.ref.linear import linear_f32
from ds4lib.ref.moe import moe
from ds4lib.ref.norm import rms_norm
from ds4lib.ref.rope import apply_rope, rope_freqs
from ds4lib.ref.state import State
from ds4lib.ref.weights import RefWeights
from ds4lib.roles import layer_roles
from ds4lib.tokenmap import load_token_map

__all__ = ["ReferenceModel", "ForwardOut", "State", "Call"]


@dataclass
class ForwardOut:
    logits: np.ndarray            # [T, V] (or [1, V] with last_only)
    features: np.ndarray | None   # [T, n_targets * D] DSpark context features (None without DSpark)


class _CallShared:
    """Call-local results handed down the stack: top-k lists per index source, candidate mask."""

    def __init__(self):
        self.topk: dict[int, np.ndarray] = {}
        self.candidates = None


@dataclass
class Call:
    """One forward call in progress: the HC state and pre-mix between layers, and call-local results."""
    ids: np.ndarray
    positions: np.ndarray
    hashes: np.ndarray | None
    state: State
    h: np.ndarray                 # [T, S, D]
    pre: np.ndarray               # [T, S]
    shared: _CallShared = field(default_factory=_CallShared)
    features: list = field(default_factory=list)
    rows: list | None = None      # a call over several sessions (`forward_rows`): [(row slice, state, shared)]


class ReferenceModel:
    """The forward over any weight source with RefWeights' interface (`layer(l)`, `global_(name)`,
    `engram_rows(l, hashes)`): the checkpoint itself (`load`), or the engine's dequantised base stack."""

    def __init__(self, cfg, weights, token_map=None, quant_sim: bool = True):
        self.cfg, self.w, self.quant_sim = cfg, weights, quant_sim
        self.roles = layer_roles(cfg)
        self.geometry = engram_geometry(cfg) if cfg.engram_layer_ids else None
        if self.geometry is not None and token_map is None:
            raise ValueError("a model with Engram layers needs the compressed token map")
        self.token_map = token_map
        self.pad_cid = int(self.token_map[cfg.engram_pad_id]) if self.token_map is not None else 0
        args = (cfg.original_seq_len, cfg.rope_factor, cfg.beta_fast, cfg.beta_slow)
        self.freqs = {False: rope_freqs(cfg.rope_head_dim, cfg.rope_theta, False, *args),
                      True: rope_freqs(cfg.rope_head_dim, cfg.compress_rope_theta, True, *args)}

    @classmethod
    def load(cls, checkpoint_dir, quant_sim: bool = True, cache_bytes: int = 4 << 30) -> "ReferenceModel":
        reader = CheckpointReader.open(Path(checkpoint_dir))
        cfg = reader.cfg
        tmap = load_token_map(reader.root, cfg) if cfg.engram_layer_ids else None
        model = cls(cfg, RefWeights(reader, cache_bytes), tmap, quant_sim)
        model.reader = reader
        return model

    def new_state(self) -> State:
        return State(self.cfg, self.roles, max(self.cfg.engram_max_ngram_size - 1, 1))

    # ------------------------------------------------------------------ public API
    def logits(self, token_ids, chunk: int = 512) -> np.ndarray:
        """Teacher-forced FP32 logits [T, V] for a fresh sequence (chunked prefill, identical results)."""
        ids = np.asarray(token_ids, dtype=np.int64)
        state = self.new_state()
        return np.concatenate([self.forward(ids[i:i + chunk], state).logits for i in range(0, len(ids), chunk)])

    def forward(self, token_ids, state: State, *, last_only: bool = False, observer=None) -> ForwardOut:
        """Run tokens at positions state.pos.. and advance the state."""
        call = self.begin(token_ids, state)
        for l in range(self.cfg.n_layers):
            self.run_layer(call, l, observer)
        return self.finish(call, last_only, observer)

    def forward_rows(self, token_ids, states) -> ForwardOut:
        """One token for each of B distinct sessions in one call (the server's concurrent requests): embeddings,
        mixes, projections, experts and head over the B rows at once, each session's attention state per session;
        advances every state. Row b equals forward([token_ids[b]], states[b], last_only=True) bit for bit: every sum
        is formed in float64 and rounded once, whatever the row count (ds4lib.ref.linear)."""
        if len(token_ids) != len(states) or not len(states):
            raise ValueError("forward_rows needs one token per session")
        if len({id(st) for st in states}) != len(states):
            raise ValueError("forward_rows: a session appears twice in one call")
        calls = [self.begin([t], st) for t, st in zip(token_ids, states)]
        call = Call(ids=np.concatenate([c.ids for c in calls]), positions=np.concatenate([c.positions for c in calls]),
                    hashes=None if calls[0].hashes is None else np.concatenate([c.hashes for c in calls]), state=None,
                    h=np.concatenate([c.h for c in calls]), pre=np.concatenate([c.pre for c in calls]),
                    rows=[(slice(b, b + 1), c.state, c.shared) for b, c in enumerate(calls)])
        for l in range(self.cfg.n_layers):
            self.run_layer(call, l)
        return self.finish(call)

    def begin(self, token_ids, state: State) -> "Call":
        """Start a call: Engram hashes, embeddings, the initial one-hot pre-mix."""
        cfg = self.cfg
        ids = np.asarray(token_ids, dtype=np.int64)
        if ids.ndim != 1 or len(ids) == 0:
            raise ValueError("forward needs a non-empty 1-D token list")
        if ids.min() < 0 or ids.max() >= cfg.vocab_size:
            raise ValueError(f"token id outside the vocabulary [0, {cfg.vocab_size})")
        T, p0 = len(ids), state.pos
        hashes = None
        if self.geometry is not None:
            cids = np.where(ids == cfg.image_token_id, -1, self.token_map[ids])
            hashes, state.engram_hist = engram_hashes(cids, state.engram_hist, self.geometry, self.pad_cid)
        emb = self.w.global_(EMBED)[ids]
        pre = np.zeros((T, cfg.hc_mult), dtype=np.float32)
        pre[:, 0] = 1.0
        return Call(ids=ids, positions=np.arange(p0, p0 + T, dtype=np.int64), hashes=hashes, state=state,
                    h=np.repeat(emb[:, None, :], cfg.hc_mult, axis=1), pre=pre)

    def run_layer(self, call: "Call", l: int, observer=None) -> None:
        """Advance call.h / call.pre through backbone layer l (its Engram, then the block)."""
        cfg, role, w = self.cfg, self.roles[l], self.w.layer(l)
        if role.engram:
            rows = self.w.engram_rows(l, call.hashes[:, role.engram_index])
            call.h = engram_apply(call.h, rows, w, cfg, self.quant_sim, dead=call.ids == cfg.image_token_id)
            if observer:
                observer(l, "engram_out", call.h)
        if role.dspark_target:
            call.features.append(round_bf16(call.h.mean(axis=1, dtype=np.float32)))
        if observer:
            observer(l, "block_in", call.h)

        def attend(x):
            return self._attention(role, w, x, call.positions, call.state, call.shared, observer, rows=call.rows)
        call.h, call.pre = self._block(l, w, call.h, call.pre, attend, observer)

    def finish(self, call: "Call", last_only: bool = False, observer=None) -> ForwardOut:
        """Final collapse with the last block's pre-mix, norm and head; advances the state's position."""
        cfg = self.cfg
        for r, state, _ in call.rows or [(slice(None), call.state, None)]:
            state.pos = int(call.positions[r][-1]) + 1
        y = hc_pre(call.h, call.pre)
        if last_only:
            y = y[-1:]
        logits = linear_f32(rms_norm(y, self.w.global_(NORM), cfg.norm_eps), self.w.global_(HEAD))
        features = np.concatenate(call.features, axis=-1) if call.features else None
        if observer and features is not None:
            observer(-1, "features", features)
        return ForwardOut(logits, features)

    # ------------------------------------------------------------------ block and attention
    def _block(self, l, w, h, pre_in, attend, observer):
        cfg = self.cfg
        kw = dict(norm_eps=cfg.norm_eps, hc_eps=cfg.hc_eps, iters=cfg.hc_sinkhorn_iters)
        a_pre, a_post, a_comb = hc_mixes(h, w["hc_attn_fn"], w["hc_attn_base"], w["hc_attn_scale"], **kw)
        x = rms_norm(hc_pre(h, pre_in), w["attn_norm.weight"], cfg.norm_eps)
        y = attend(x)
        if observer:
            observer(l, "attn_out", y)
        h = hc_post(y, h, a_post, a_comb)
        f_pre, f_post, f_comb = hc_mixes(h, w["hc_ffn_fn"], w["hc_ffn_base"], w["hc_ffn_scale"], **kw)
        x = rms_norm(hc_pre(h, a_pre), w["ffn_norm.weight"], cfg.norm_eps)
        obs = (lambda name, v: observer(l, name, v)) if observer else None
        if observer:
            observer(l, "moe_in", x)
        y = moe(x, w, cfg, self.roles[l].top_k, self.quant_sim, observe=obs)
        if observer:
            observer(l, "moe_out", y)
        h = hc_post(y, h, f_post, f_comb)
        if observer:
            observer(l, "block_out", h)
            observer(l, "block_pre", f_pre)
            observer(l, "block_post", f_post)
        return h, f_pre

    def _window(self, l, kv, P, state):
        """Window candidate rows for queries P: rows before the call and the call's own rows."""
        W = self.cfg.window_size
        keys = np.concatenate([state.win_kv[l], kv])
        kpos = np.concatenate([state.win_pos[l], P])
        mask = (kpos[None, :] <= P[:, None]) & (kpos[None, :] > P[:, None] - W)
        state.win_kv[l], state.win_pos[l] = keys[-W:], kpos[-W:]
        return keys, mask

    def _attention(self, role, w, x, P, state, shared, observer, rows=None):
        """The layer's attention over x [T, D] at positions P. `rows`: a batched call's sessions [(row slice,
        state, shared)] (`forward_rows`); the projections run over all rows at once, what reads or writes a session's
        state (window, compressor, indexer, sparse attention) per session."""
        cfg, qs = self.cfg, self.quant_sim
        freqs = self.freqs[role.yarn]
        qr, q = query_path(x, w, cfg, P, freqs, qs)
        kv = window_kv(x, w, cfg, P, freqs, qs)
        if rows is None:
            o = self._attend_session(role, w, x, P, qr, q, kv, state, shared, observer)
        else:
            o = np.concatenate([self._attend_session(role, w, x[r], P[r], qr[r], q[r], kv[r], st, sh, observer)
                                for r, st, sh in rows])
        return output_projection(o, w, cfg, P, freqs, qs)

    def _attend_session(self, role, w, x, P, qr, q, kv, state, shared, observer):
        """One session's rows of a layer's attention: its window, compressed rows and top-k, sparse attention."""
        cfg, l, qs = self.cfg, role.layer, self.quant_sim
        freqs = self.freqs[role.yarn]
        keys, mask = self._window(l, kv, P, state)
        cmp_keys = cmp_valid = None
        if role.ratio:
            ratio = role.ratio
            if role.owns_compressor:
                lat, gids = compress(x, w, cfg, ratio, int(P[0]), state.pending[l])
                if len(lat):
                    if role.indexer_owns_k:
                        state.idxk[l].append(index_keys(lat, w, cfg, gids, ratio, freqs, qs))
                    ck = apply_rope(lat, gids * ratio, freqs)
                    state.ckv[l].append(act_quant_fp4_e4m3(ck, 16) if qs else ck)
            if role.owns_indexer:
                keys_i = state.idxk[role.kv_src].view()
                r = reach(P, ratio)
                k = min(cfg.index_topk, (int(P[-1]) + 1) // ratio)
                if k == 0:
                    shared.topk[l] = np.zeros((len(P), 0), dtype=np.int64)
                else:
                    sc = index_scores(x, qr, w, cfg, keys_i, P, ratio, freqs, qs)
                    if observer:
                        observer(l, "index_scores", sc)
                    if role.publishes_candidates:
                        shared.candidates = candidate_blocks(sc, r, cfg.candidate_topk_blocks,
                                                             cfg.candidate_block_size)
                        if observer:
                            observer(l, "candidates", shared.candidates)
                    if role.consumes_candidates:
                        sc = np.where(shared.candidates, sc, -np.inf)
                    shared.topk[l] = select_topk(sc, r, k)
                if observer:
                    observer(l, "topk", shared.topk[l])
            idx = shared.topk[role.idx_src]
            ckv = state.ckv[role.kv_src].view()
            cmp_keys = ckv[np.maximum(idx, 0)] if idx.shape[1] else np.zeros((len(P), 0, cfg.head_dim), np.float32)
            cmp_valid = idx >= 0
        return sparse_attention(q, keys, mask, cmp_keys, cmp_valid, w["attn.attn_sink"], cfg.head_dim ** -0.5)

    # ------------------------------------------------------------------ DSpark
    def dspark_append(self, state: State, features, positions) -> None:
        """Append DSpark context rows for target positions (their features [T, n_targets*D])."""
        cfg = self.cfg
        P = np.asarray(positions, dtype=np.int64)
        main_x = dsp.context_input(features, self.w.layer(cfg.n_layers), cfg, self.quant_sim)
        W = cfg.window_size
        for role in self.roles[cfg.n_layers:]:
            kv = window_kv(main_x, self.w.layer(role.layer), cfg, P, self.freqs[False], self.quant_sim)
            l = role.layer
            state.win_kv[l] = np.concatenate([state.win_kv[l], kv])[-W:]
            state.win_pos[l] = np.concatenate([state.win_pos[l], P])[-W:]

    def rollback(self, state: State, mark, kept_ids) -> None:
        """Undo all but the first len(kept_ids) tokens fed since `mark = state.mark()` (speculative verification):
        afterwards the state equals that of feeding only kept_ids, array for array (State.rollback)."""
        kept = np.asarray(kept_ids, dtype=np.int64)
        hist = mark.engram_hist
        if self.geometry is not None and len(kept):
            cids = np.where(kept == self.cfg.image_token_id, -1, self.token_map[kept])
            _, hist = engram_hashes(cids, hist, self.geometry, self.pad_cid)
        ratios = {r.layer: r.ratio for r in self.roles if r.owns_compressor or r.indexer_owns_k}
        state.rollback(mark, len(kept), ratios, hist)

    def dspark_propose(self, state: State, anchor: int, start_pos: int, pick=None, observer=None):
        """Draft a block after the target processed positions <= start_pos and produced `anchor` (the token
        at start_pos + 1). Block positions start_pos+1 .. start_pos+B; the rings are read, not written."""
        y = self.dspark_hidden(state, anchor, start_pos, observer)
        return self.dspark_draft(y, anchor, pick)

    def dspark_draft(self, y, anchor: int, pick=None):
        """The drafts of a block from its collapsed last-stage state y [B, D] (dspark.draft_tokens)."""
        cfg = self.cfg
        return dsp.draft_tokens(y, anchor, self.w.layer(cfg.n_all_layers - 1), self.w.global_(HEAD), cfg, pick)

    def dspark_hidden(self, state: State, anchor: int, start_pos: int, observer=None):
        """The draft stages over the block [anchor, noise...] at start_pos+1..: the collapsed state y [B, D]."""
        cfg = self.cfg
        B = cfg.dspark_block_size
        ids = np.full(B, cfg.dspark_noise_token_id, dtype=np.int64)
        ids[0] = anchor
        P = np.arange(start_pos + 1, start_pos + 1 + B, dtype=np.int64)
        h = np.repeat(self.w.global_(EMBED)[ids][:, None, :], cfg.hc_mult, axis=1)
        pre = np.zeros((B, cfg.hc_mult), dtype=np.float32)
        pre[:, 0] = 1.0
        for role in self.roles[cfg.n_layers:]:
            l, w = role.layer, self.w.layer(role.layer)

            def attend(x, l=l, w=w):
                freqs = self.freqs[False]
                _, q = query_path(x, w, cfg, P, freqs, self.quant_sim)
                kb = window_kv(x, w, cfg, P, freqs, self.quant_sim)
                keys = np.concatenate([state.win_kv[l], kb])
                mask = np.ones((B, len(keys)), dtype=bool)
                o = sparse_attention(q, keys, mask, None, None, w["attn.attn_sink"], cfg.head_dim ** -0.5)
                return output_projection(o, w, cfg, P, freqs, self.quant_sim)
            h, pre = self._block(l, w, h, pre, attend, observer)
        return hc_pre(h, pre)
