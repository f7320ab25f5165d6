"""Speculative acceptance on the device: which drafts of a round are kept and the token that follows
(ds4lib.engine.speculative.verify_rows and residual_token are the reference; issue 13).

Owns `accept(target, draft, drafts, k, io, ...)`: target rows p_0..p_k [k + 1, V] (the verify call's logits), draft
rows q_1..q_k [>= k, V] (the proposal's logits, the rows the drafts were drawn from), drafts [>= k] int64 on the
device, and `io` int64 [3] (host-mapped: seed, first position F + 1, the bonus step) -> out int64 [2] = (n kept,
next token), with the host's semantics:
- temperature 0: n = the first j whose draft is not the argmax of p_j (the lowest index among equal maxima, as
  np.argmax), the token that argmax; all kept: the argmax of p_k.
- sampled: p_j and q_j are ds4lib.ref.sampling.probabilities of the rows at the request's temperature and truncation
  (the kept sets from kernels.sampling.truncate's thresholds; exp(z) / the kept mass, float64); draft d_j is kept
  while u_j q_j(d_j) < p_j(d_j), u_j the uniform of (seed, step ACCEPT << 56 | F + 1 + j, index 0); the first
  rejected one is replaced by argmax over r_i = p_i - q_i > 0 of log r_i - log(-log u_i) (uniforms of step
  RESIDUAL << 56 | position, token i's the i-th; where no r_i is positive, argmax over p's kept tokens of
  z_i - log(-log u_i), the sampler's own draw); all kept: the device sampler's token of p_k at the bonus step.
The kept masses are summed in a fixed order (one block per row, a tree), not numpy's: a p or q value can differ from
the host's in its last bits, so a draw on the edge of a tie may differ; the distribution is the same.

Kernels: `spec_mass_kernel` (a row's kept mass), `spec_residual_kernel` (per block of a row: the best residual and
fallback candidates), `spec_decide_kernel` (one thread walks the drafts in order). The launches depend only on k and
the sampling parameters, so the backend replays them from a graph.

Shapes: k drafts, V vocab, NB = ceil(V / chunk) blocks per row.
"""
import math

import numpy as np
from numba import cuda

from kernels import inline_device
from kernels.pdl import grid_entry_device
from kernels.sampling import (CHUNK, F_MAX, FIXED_ONE, NEG_INF64, S_ARGMAX, S_THETA_K, S_THETA_P, THREADS,
                              _block_best_device, _order_key_device, _weight_device, philox_uniform_device, sample,
                              truncate)
from kernels.scratch import scratch_array as _scratch

__all__ = ["accept", "spec_mass_kernel", "spec_residual_kernel", "spec_decide_kernel", "ACCEPT", "RESIDUAL",
           "PURPOSE_SHIFT", "SIGNATURES"]

ACCEPT, RESIDUAL = 2, 3            # ds4lib.engine.speculative's purposes
PURPOSE_SHIFT = 56


@inline_device
def _prob_device(v, m, theta, temperature, min_p, mass):
    """(p, z, kept) of a logit v in a row of max m, threshold key theta and kept mass `mass`."""
    z, w = _weight_device(v, m, temperature)
    keep = _order_key_device(v) >= theta and (min_p <= 0.0 or np.float64(w) >= min_p * FIXED_ONE)
    return (math.exp(z) / mass if keep else 0.0), z, keep


@cuda.jit(cache=True)
def spec_mass_kernel(logits, temperature, min_p, st, stf, mass):
    """mass[b] = sum of exp(z) over row b's kept tokens (float64; a thread's tokens in order, then a tree)."""
    grid_entry_device()
    b = cuda.blockIdx.x
    tid = cuda.threadIdx.x
    n = logits.shape[1]
    theta = max(st[b, S_THETA_K], st[b, S_THETA_P])
    m = stf[b, F_MAX]
    acc = 0.0
    for i in range(tid, n, THREADS):
        v = logits[b, i]
        z, w = _weight_device(v, m, temperature)
        if _order_key_device(v) >= theta and (min_p <= 0.0 or np.float64(w) >= min_p * FIXED_ONE):
            acc += math.exp(z)
    sh = cuda.shared.array(THREADS, np.float64)
    sh[tid] = acc
    cuda.syncthreads()
    s = THREADS // 2
    while s > 0:
        if tid < s:
            sh[tid] += sh[tid + s]
        cuda.syncthreads()
        s //= 2
    if tid == 0:
        mass[b] = sh[0]


@cuda.jit(cache=True)
def spec_residual_kernel(target, draft, chunk, temperature, min_p, st_t, stf_t, st_d, stf_d, mass_t, mass_d, io,
                         part_r, part_ri, part_p, part_pi):
    """Per block of row j (grid.y, j < k): the best log(p_i - q_i) + G_i over r_i > 0 (part_r / part_ri) and the best
    z_i + G_i over p's kept tokens (part_p / part_pi), G_i = -log(-log u_i), u of step RESIDUAL << 56 | io[1] + j."""
    grid_entry_device()
    j = cuda.blockIdx.y
    blk = cuda.blockIdx.x
    n = target.shape[1]
    seed = io[0]
    step = (np.int64(RESIDUAL) << PURPOSE_SHIFT) | (io[1] + j)
    th_t = max(st_t[j, S_THETA_K], st_t[j, S_THETA_P])
    th_d = max(st_d[j, S_THETA_K], st_d[j, S_THETA_P])
    m_t = stf_t[j, F_MAX]
    m_d = stf_d[j, F_MAX]
    br = NEG_INF64
    bri = np.int64(n)
    bp = NEG_INF64
    bpi = np.int64(n)
    for i in range(blk * chunk + cuda.threadIdx.x, min(n, (blk + 1) * chunk), THREADS):
        p, z, keep = _prob_device(target[j, i], m_t, th_t, temperature, min_p, mass_t[j])
        if not keep:
            continue
        q = _prob_device(draft[j, i], m_d, th_d, temperature, min_p, mass_d[j])[0]
        g = -math.log(-math.log(philox_uniform_device(seed, step, i)))
        if z + g > bp or (z + g == bp and i < bpi):
            bp = z + g
            bpi = i
        r = p - q
        if r > 0.0:
            c = math.log(r) + g
            if c > br or (c == br and i < bri):
                br = c
                bri = i
    sh_v = cuda.shared.array(THREADS, np.float64)
    sh_i = cuda.shared.array(THREADS, np.int64)
    _block_best_device(br, bri, sh_v, sh_i)
    if cuda.threadIdx.x == 0:
        part_r[j, blk] = sh_v[0]
        part_ri[j, blk] = sh_i[0]
    cuda.syncthreads()
    _block_best_device(bp, bpi, sh_v, sh_i)
    if cuda.threadIdx.x == 0:
        part_p[j, blk] = sh_v[0]
        part_pi[j, blk] = sh_i[0]


@inline_device
def _best_of_blocks_device(part_v, part_i, j):
    """(best value, its index) of row j over the blocks, lowest index on ties."""
    bv = part_v[j, 0]
    bi = part_i[j, 0]
    for b in range(1, part_v.shape[1]):
        if part_v[j, b] > bv or (part_v[j, b] == bv and part_i[j, b] < bi):
            bv = part_v[j, b]
            bi = part_i[j, b]
    return bv, bi


@cuda.jit(cache=True)
def spec_decide_kernel(target, draft, drafts, k, temperature, min_p, st_t, stf_t, st_d, stf_d, mass_t, mass_d, io,
                       part_r, part_ri, part_p, part_pi, bonus, out):
    """One thread: out = (n kept, next token) (module docstring)."""
    grid_entry_device()
    if cuda.threadIdx.x != 0 or cuda.blockIdx.x != 0:
        return
    for j in range(k):
        d = drafts[j]
        if temperature == 0.0:
            a = st_t[j, S_ARGMAX]
            if d != a:
                out[0] = j
                out[1] = a
                return
            continue
        th_t = max(st_t[j, S_THETA_K], st_t[j, S_THETA_P])
        th_d = max(st_d[j, S_THETA_K], st_d[j, S_THETA_P])
        p = _prob_device(target[j, d], stf_t[j, F_MAX], th_t, temperature, min_p, mass_t[j])[0]
        q = _prob_device(draft[j, d], stf_d[j, F_MAX], th_d, temperature, min_p, mass_d[j])[0]
        u = philox_uniform_device(io[0], (np.int64(ACCEPT) << PURPOSE_SHIFT) | (io[1] + j), 0)
        if not u * q < p:
            bv, bi = _best_of_blocks_device(part_r, part_ri, j)
            if bv == NEG_INF64:                          # no r_i > 0: p == q, the sampler's draw from p
                bv, bi = _best_of_blocks_device(part_p, part_pi, j)
            out[0] = j
            out[1] = bi
            return
    out[0] = k
    out[1] = st_t[k, S_ARGMAX] if temperature == 0.0 else bonus[0]


SIGNATURES = {
    "spec_mass_kernel": "void(float32[:, :], float64, float64, int64[:, :], float64[:, :], float64[:])",
    "spec_residual_kernel": "void(float32[:, :], float32[:, :], int64, float64, float64, int64[:, :], float64[:, :], "
                            "int64[:, :], float64[:, :], float64[:], float64[:], int64[:], float64[:, :], "
                            "int64[:, :], float64[:, :], int64[:, :])",
    "spec_decide_kernel": "void(float32[:, :], float32[:, :], int64[:], int64, float64, float64, int64[:, :], "
                          "float64[:, :], int64[:, :], float64[:, :], float64[:], float64[:], int64[:], "
                          "float64[:, :], int64[:, :], float64[:, :], int64[:, :], int64[:], int64[:])",
}


def accept(target, draft, drafts, k, io, *, temperature, top_k=0, top_p=1.0, min_p=0.0, out=None, chunk=CHUNK,
           scratch=None, stream=0):
    """(module docstring) target float32 [k + 1, V], draft float32 [>= k, V], drafts int64 [>= k], io int64 [3]
    (seed, F + 1, bonus step) -> out int64 [2] (n, token) on the device. Launches only: nothing is read back."""
    k = int(k)
    n_rows, n_vocab = tuple(target.shape)
    if target.dtype != np.float32 or n_rows != k + 1 or k < 0:
        raise ValueError(f"accept: target must be float32 [k + 1 = {k + 1}, V], got {target.dtype}{target.shape}")
    if draft.dtype != np.float32 or draft.shape[1] != n_vocab or draft.shape[0] < k or drafts.shape[0] < k \
            or drafts.dtype != np.int64:
        raise ValueError(f"accept: draft float32 [>= {k}, {n_vocab}] and drafts int64 [>= {k}] expected, got "
                         f"{draft.dtype}{draft.shape}, {drafts.dtype}{drafts.shape}")
    if tuple(io.shape) != (3,) or io.dtype != np.int64:
        raise ValueError("accept: io must be int64 [3] (seed, first position, bonus step)")
    if out is None:
        out = cuda.device_array(2, np.int64, stream=stream)
    temperature = float(temperature)
    st_t, stf_t, _ = truncate(target, temperature=temperature, top_k=top_k, top_p=top_p, chunk=chunk,
                              tokens=_scratch(scratch, "sa_tok_t", (k + 1,), np.int64, stream), scratch=scratch,
                              name="sa_t_", stream=stream)
    nb = math.ceil(n_vocab / chunk)
    parts = (_scratch(scratch, "sa_r", (max(k, 1), nb), np.float64, stream),
             _scratch(scratch, "sa_ri", (max(k, 1), nb), np.int64, stream),
             _scratch(scratch, "sa_p", (max(k, 1), nb), np.float64, stream),
             _scratch(scratch, "sa_pi", (max(k, 1), nb), np.int64, stream))
    mass_t = _scratch(scratch, "sa_mass_t", (k + 1,), np.float64, stream)
    mass_d = _scratch(scratch, "sa_mass_d", (max(k, 1),), np.float64, stream)
    bonus = _scratch(scratch, "sa_bonus", (1,), np.int64, stream)
    st_d, stf_d = st_t, stf_t
    if temperature > 0:
        if k:
            dr = draft[:k]
            st_d, stf_d, _ = truncate(dr, temperature=temperature, top_k=top_k, top_p=top_p, chunk=chunk,
                                      tokens=_scratch(scratch, "sa_tok_d", (k,), np.int64, stream), scratch=scratch,
                                      name="sa_d_", stream=stream)
            spec_mass_kernel[k + 1, THREADS, stream](target, temperature, float(min_p), st_t, stf_t, mass_t)
            spec_mass_kernel[k, THREADS, stream](dr, temperature, float(min_p), st_d, stf_d, mass_d)
            spec_residual_kernel[(nb, k), THREADS, stream](target, dr, chunk, temperature, float(min_p), st_t, stf_t,
                                                           st_d, stf_d, mass_t, mass_d, io, *parts)
        sample(target[k:k + 1], io[0:1], io[2:3], temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
               chunk=chunk, out=bonus, scratch=scratch, stream=stream)
    spec_decide_kernel[1, 32, stream](target, draft, drafts, k, temperature, float(min_p), st_t, stf_t, st_d, stf_d,
                                      mass_t, mass_d, io, *parts, bonus, out)
    return out
