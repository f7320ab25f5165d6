"""The DSpark draft stages on the CUDA backend (ds4lib.ref.model's dspark_propose / dspark_append, ds4lib.ref.dspark;
docs/architecture.md §9; issue 13).

Owns `CudaDraft`, bound to a CudaBackend whose weights include the stages (cuda_weights.upload_base(stages=True)):
- `add_rings(st)`: the stages' context rings on a session state: per stage W ring rows then room for a block
  (`dwin_all` [n_stages, W + B, Dh] BF16 bits, `dring_pos_all` [n_stages, W] on the device) and a host mirror of the
  positions they hold (`dring_host` [W]; every stage holds the same positions).
- `append_context(st, features, positions)`: context rows of fed target positions (their DSpark features [T, F], the
  backbone forward's `ForwardOut.features`): main_x = main_norm(main_proj(features)) (stage 0's weights), then each
  stage's window key of main_x written into its ring (the window_kv path of the backbone's attention); only the last W
  rows can reach a ring.
- `defer(st, feature_row, position)`: a decode step's features copied to the state's pending rows (one device copy
  instead of a context append's ~10 launches per plain step); the pending rows are appended in one call (two where
  the slots wrap) before anything reads or writes the rings (`flush`: propose, append_context).
- `propose(st, anchor, start_pos, pick)`: the stages over the block [anchor, noise...] at start_pos + 1 ..
  start_pos + B, each block row attending to every context row of the ring (in position order, as the reference
  concatenates them) and to every block row, the rings read, not written; then the draft head: base logits
  head(norm(y)), per position the Markov bias of the previous token (its embedding row gathered from the q8_0 / q4_K
  table, or from an FP32 copy of an F16 one, the head GEMV, kernels.dspark.markov_add) and the draft as the device argmax (kernels.sampling at
  temperature 0: the lowest index among equal maxima, as np.argmax), or `pick(logits_row)` on the host for sampled
  drafts (the row is copied back, the drawn token uploaded). The confidence logits are formed on the host from the
  collapsed state and the Markov rows by the reference's own FP32 linear (B x (D + R) values).
Greedy proposals make no host round trip until the end (tokens, collapsed state and Markov rows are read back once).

Shapes: B block size, W window, Dh head dim, D hidden, S streams, R Markov rank, V vocab, F feature width.
"""
from __future__ import annotations

import numpy as np

import kernels  # noqa: F401  (numpy 2.5 alias for numba-cuda before anything compiles)
from numba import cuda

from ds4lib.formats.floats import bf16_bits_to_f32
from ds4lib.ref.dspark import Proposal
from ds4lib.ref.linear import linear_f32
from kernels import attention, dspark, hc, q4k_gemv, rms_norm, sampling

__all__ = ["CudaDraft"]


def _host_f32(w):
    """A device weight (a cuda_weights.Lin of BF16 bits or FP32, or a plain FP32 array) as a host FP32 array."""
    a = getattr(w, "w", w).copy_to_host()
    return bf16_bits_to_f32(a) if a.dtype == np.uint16 else a.astype(np.float32)


class _DraftCall:
    """What the backend's layer step reads of a call, for a draft block or a context append."""

    def __init__(self, T, pos):
        self.T, self.pos = T, pos
        self.pre = None
        self.feat = None
        self.engram_rows = {}
        self.dead = None


class CudaDraft:
    def __init__(self, backend):
        self.be = be = backend
        cfg = be.cfg
        self.cfg = cfg
        self.stages = [r.layer for r in be.roles[cfg.n_layers:cfg.n_all_layers]]
        self.B = cfg.dspark_block_size
        last = be.L[cfg.n_all_layers - 1]
        emb = last["markov_head.embed.weight"]
        if getattr(emb, "kind", None) in ("q4_K", "q8_0"):
            self._gather = lambda ids, out: q4k_gemv.q4k_rows(emb.w, ids, kind=emb.kind, out=out, stream=be.stream)
        else:                                           # F16 (R not a multiple of 32) or stored: an FP32 table
            table = cuda.to_device(_host_f32(emb), stream=be.stream)
            self._gather = lambda ids, out: dspark.table_rows(table, ids, out, stream=be.stream)
        self.conf_w = _host_f32(last["confidence_head.proj.weight"])   # [1, D + R]

    # ------------------------------------------------------------------ context rings
    def add_rings(self, st) -> None:
        cfg, s = self.cfg, self.be.stream
        W, n = cfg.window_size, len(self.stages)
        st.dwin_all = cuda.device_array((n, W + self.B, cfg.head_dim), np.uint16, stream=s)
        st.dring_pos_all = cuda.to_device(np.full((n, W), -1, dtype=np.int64), stream=s)
        st.dring_host = np.full(W, -1, dtype=np.int64)
        st.dfeat_pend = cuda.device_array((W, self.be.n_feat), np.float32, stream=s)
        st.dpend = []

    def defer(self, st, feature_row, position: int) -> None:
        """Keep a decode step's features [1, F] (a device buffer the next step overwrites: copied now, on the stream)
        as the pending context row of `position` (module docstring)."""
        p = int(position)
        if st.dpend and st.dpend[-1] + 1 != p:
            self.flush(st)
        W = self.cfg.window_size
        st.dfeat_pend[p % W:p % W + 1].copy_to_device(feature_row, stream=self.be.stream)
        st.dpend.append(p)

    def flush(self, st) -> None:
        """Append the pending context rows (`defer`), in position order."""
        if not st.dpend:
            return
        W = self.cfg.window_size
        P = np.asarray(st.dpend[-W:], dtype=np.int64)
        st.dpend = []
        slots = P % W
        for seg in np.split(np.arange(len(P)), np.nonzero(np.diff(slots) != 1)[0] + 1):
            a, b = int(slots[seg[0]]), int(slots[seg[-1]]) + 1
            self._append(st, st.dfeat_pend[a:b], P[seg])

    def append_context(self, st, features, positions) -> None:
        self.flush(st)
        self._append(st, features, positions)

    def _append(self, st, features, positions) -> None:
        be, cfg, s = self.be, self.cfg, self.be.stream
        W = cfg.window_size
        P = np.asarray(positions, dtype=np.int64)[-W:]
        if not len(P):
            return
        feats = features[len(features) - len(P):]
        if isinstance(feats, np.ndarray):
            feats = cuda.to_device(np.ascontiguousarray(feats, dtype=np.float32), stream=s)
        if tuple(feats.shape) != (len(P), be.n_feat) or np.any(np.diff(P) != 1):
            raise ValueError(f"append_context: features {tuple(feats.shape)} for {len(P)} consecutive positions "
                             f"expected [T, {be.n_feat}]")
        T = len(P)
        be._rope_tables(int(P[-1]) + 1)
        c = _DraftCall(T, cuda.to_device(P, stream=s))
        w0 = be.L[cfg.n_layers]
        mp = be._linear(feats, w0["main_proj.weight"], quantize=True, out=be._buf("d_main_proj", (T, cfg.dim)))
        main_x = rms_norm.rms_norm(mp, w0["main_norm.weight"], cfg.norm_eps, out=be._buf("d_main_x", (T, cfg.dim)),
                                   stream=s)
        xq = be._aq8(main_x, "d_main_xq")
        for i, l in enumerate(self.stages):
            kvq = be._window_kv(l, c, xq)
            attention.window_write(kvq, c.pos, st.dwin_all[i][:W], st.dring_pos_all[i], stream=s)
        st.dring_host[P % W] = P

    # ------------------------------------------------------------------ proposals
    def _ring_index(self, st):
        """int32 [B, W + B]: the ring slots in position order, then the block rows (W + i), -1 padded."""
        W, B = self.cfg.window_size, self.B
        slots = np.nonzero(st.dring_host >= 0)[0]
        slots = slots[np.argsort(st.dring_host[slots], kind="stable")]
        row = np.full(W + B, -1, dtype=np.int32)
        row[:len(slots)] = slots
        row[len(slots):len(slots) + B] = W + np.arange(B)
        return cuda.to_device(np.ascontiguousarray(np.broadcast_to(row, (B, W + B))), stream=self.be.stream)

    def hidden(self, st, anchor: int, start_pos: int, observer=None):
        """The stages over the block [anchor, noise...] at start_pos + 1 ..: the collapsed state y [B, D] (device).
        `observer(layer, name, host array)`: the backbone layer step's observation points (diagnostics)."""
        be, cfg, s = self.be, self.cfg, self.be.stream
        B, W, S, D = self.B, cfg.window_size, cfg.hc_mult, cfg.dim
        P = np.arange(start_pos + 1, start_pos + 1 + B, dtype=np.int64)
        be._rope_tables(int(P[-1]) + 1)
        c = _DraftCall(B, cuda.to_device(P, stream=s))
        ids = np.full(B, cfg.dspark_noise_token_id, dtype=np.int64)
        ids[0] = anchor
        h = be._buf("d_h", (B, S, D))
        emb = be.g["embed"]
        q4k_gemv.q4k_rows(emb.w, cuda.to_device(np.repeat(ids, S), stream=s), kind=emb.kind, out=h.reshape(B * S, D),
                          stream=s)
        c.pre = be._const_arr(("pre0", B, S), lambda: np.eye(1, S, dtype=np.float32).repeat(B, 0))
        idx = self._ring_index(st)
        rows = be._const_arr(("win_rows", B), lambda: np.arange(W, W + B, dtype=np.int64))
        for i, l in enumerate(self.stages):
            def attend(x, l=l, i=i):
                xq, _, q3 = be._query(l, c, x)
                keys = st.dwin_all[i]
                attention.cache_write(be._window_kv(l, c, xq), rows, keys, stream=s)
                return be._output(l, c, be._attend(l, q3, keys, idx, None, None))
            be._layer(l, st, c, h, observer, attend=attend)
        return hc.hc_pre(h, c.pre, out=be._buf("d_y", (B, D)), stream=s)

    def propose(self, st, anchor: int, start_pos: int, pick=None, observer=None) -> Proposal:
        """The DSpark proposal after positions <= start_pos with `anchor` at start_pos + 1 (module docstring).
        `logits` and `base_logits` of the Proposal stay on the device. `observer`: as `hidden`'s."""
        be, cfg, s = self.be, self.cfg, self.be.stream
        B, V, R = self.B, cfg.vocab_size, cfg.dspark_markov_rank
        self.flush(st)
        y = self.hidden(st, anchor, start_pos, observer)
        wl = be.L[cfg.n_all_layers - 1]
        yn = rms_norm.rms_norm(y, wl["norm.weight"], cfg.norm_eps, out=be._buf("d_yn", (B, cfg.dim)), stream=s)
        base = be._linear(yn, be.g["head"], quantize=False, bf16=False, out=be._buf("d_base", (B, V)))
        logits = be._buf("d_logits", (B, V))
        tokens = be._buf("d_tokens", (B + 1,), np.int64)
        tokens[0:1].copy_to_device(np.array([int(anchor)], dtype=np.int64), stream=s)
        m = be._buf("d_markov", (B, R))
        bias = be._buf("d_bias", (1, V))
        zeros = be._const_arr(("d_zero_i64", 1), lambda: np.zeros(1, dtype=np.int64))
        for i in range(B):
            self._gather(tokens[i:i + 1], m[i:i + 1])
            be._linear(m[i:i + 1], wl["markov_head.head.weight"], quantize=False, bf16=False, out=bias)
            dspark.markov_add(base, i, bias, logits[i], stream=s)
            if pick is None:
                sampling.sample(logits[i].reshape(1, V), zeros, zeros, temperature=0.0, out=tokens[i + 1:i + 2],
                                scratch=be.scr, stream=s)
            else:
                row = logits[i].copy_to_host(stream=s)
                s.synchronize()                                # the copy is asynchronous on the stream
                t = int(pick(row))
                tokens[i + 1:i + 2].copy_to_device(np.array([t], dtype=np.int64), stream=s)
        toks = tokens.copy_to_host(stream=s)
        y_h, m_h = y.copy_to_host(stream=s), m.copy_to_host(stream=s)
        s.synchronize()
        conf = linear_f32(np.concatenate([y_h, m_h], axis=1), self.conf_w)[:, 0]
        return Proposal(toks.astype(np.int64), logits, base, conf.astype(np.float32))
