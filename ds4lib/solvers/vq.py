"""Lloyd codebook training and nearest-codeword assignment for 8-dimensional VQ (docs/design.md §2.2), CPU path.

Owns the math of the base quantizer: row gains, row normalisation, equidistant sampling, the codebook
preparation both assignment paths share, the assignment and update rules, and the Lloyd loop over an
abstract backend (`LloydBackend`). The CPU backend (`CpuLloyd`, Numba parallel) lives here; the CUDA backend
(ds4lib.quant.cuda_backend, kernels/vq_assign.py and kernels/vq_accumulate.py) implements the same rules,
and tests hold the two to identical bytes. No files, model objects or argparse.

Shape legend: N vectors, K codewords, 8 the vector width (VQ_DIM), R rows, J = in/8 vectors per row.

Determinism by construction, on every backend and any thread or block count:
- Initial codebook: pool vectors at equidistant positions floor(k*N/K) (no random source).
- Assignment: argmin_k d_k with d_k = |c_k|^2 + sum_i x_i * (-2 c_k,i), accumulated in float32 in the fixed
  order i = 0..7, ties to the lowest k. Both x and c are first rounded to 12 significant bits
  (`round_sig12`, |v| < 2^-60 flushed to 0), so every product x_i * c_i is exact in float32: whether a
  compiler fuses multiply and add (FMA contraction, which CUDA does and the CPU may not) cannot change a
  single bit, and neither can the simulator's unfused arithmetic. |c|^2 is computed once on the host.
  The effect on quality is nil: the rounding moves x by at most 2^-12 relative, and only the choice of
  index uses the rounded values (measured on ds4-tiny layer 4, 221 K vectors, 4,096 codewords: 0.019 % of
  the vectors pick another codeword than an exact float64 argmin, and the distortion changes by 2.6e-8).
- Update: each vector component enters as the int64 fixed-point value floor(x * 2^24 + 0.5); per-codeword
  sums are exact integer sums (associative, so atomics or threads in any order give the same result),
  then mean = sum / (count * 2^24) in float64, rounded once to float32. An empty cell keeps its codeword.
  Exact while N * max|x| * 2^24 < 2^63 (checked): 7.6e9 vectors of |x| <= 72, i.e. any row of <= 5120
  weights normalised to RMS 1.
- A fixed number of rounds. The final codebook is rounded to E4M3 and gains to f16 before the final
  assignment, so the reported error is the engine's.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numba
import numpy as np
from numba import njit, prange

from ds4lib.formats.fp8 import e4m3_round
from ds4lib.formats.vq import VQ_DIM, encode_gains

__all__ = [
    "DIM", "FIXED_SHIFT", "FIXED_SCALE", "POOL_PER_CODEWORD", "DEFAULT_ROUNDS", "TILE", "round_sig12",
    "prepare_codebook", "PreparedCodebook", "equidistant", "to_fixed", "finalize_update", "row_gains", "normalize_rows",
    "assign_reference", "LloydBackend", "CpuLloyd", "TrainResult", "train_codebook", "pool_size",
    "relative_distortion", "matrix_error", "check_fixed_range",
]

DIM = VQ_DIM
FIXED_SHIFT = 24
FIXED_SCALE = float(1 << FIXED_SHIFT)
POOL_PER_CODEWORD = 1024          # training pool: up to this many vectors per codeword (SEED: >= 1,000)
DEFAULT_ROUNDS = 32               # Lloyd rounds of the base quantizer (ds4-tiny: 16 -> 32 rounds gains 0.4 %)
TILE = 256                        # vectors per CPU tile (SIMD across vectors; 256: 17 % less CPU than 64)
_SIG_DROP = 12                    # float32 mantissa bits dropped by round_sig12 (24 - 12)
_FLUSH_BITS = np.uint32((127 - 60) << 23)      # |v| < 2^-60 -> 0


def round_sig12(x) -> np.ndarray:
    """float32 values rounded to 12 significant bits (nearest, ties to even); |v| < 2^-60 -> +0."""
    a = np.ascontiguousarray(x, dtype=np.float32)
    u = a.view(np.uint32)
    mag = u & np.uint32(0x7FFFFFFF)
    lsb = (u >> np.uint32(_SIG_DROP)) & np.uint32(1)
    r = (u + np.uint32((1 << (_SIG_DROP - 1)) - 1) + lsb) & np.uint32(0xFFFFFFFF ^ ((1 << _SIG_DROP) - 1))
    r = np.where(mag < _FLUSH_BITS, np.uint32(0), r).astype(np.uint32)
    return r.view(np.float32)


@dataclass(frozen=True)
class PreparedCodebook:
    """What both assignment paths read: cbm2 = -2 * round_sig12(C) [K, 8], cnorm = |round_sig12(C)|^2 [K]."""
    cbm2: np.ndarray
    cnorm: np.ndarray

    @property
    def k(self) -> int:
        return self.cbm2.shape[0]


def prepare_codebook(codebook) -> PreparedCodebook:
    c = round_sig12(np.asarray(codebook, dtype=np.float32).reshape(-1, DIM))
    c64 = c.astype(np.float64)
    cnorm = (c64 * c64).sum(axis=1).astype(np.float32)       # products exact in float64
    return PreparedCodebook(np.ascontiguousarray(c * np.float32(-2)), np.ascontiguousarray(cnorm))


def equidistant(n: int, m: int) -> np.ndarray:
    """m positions floor(i*n/m) in [0, n) (int64, exact for n*m < 2^63)."""
    return (np.arange(m, dtype=np.int64) * np.int64(n)) // np.int64(m)


def to_fixed(x) -> np.ndarray:
    """Vector components -> int64 fixed point floor(x * 2^24 + 0.5) (the update's exact representation)."""
    return np.floor(np.asarray(x, dtype=np.float32).astype(np.float64) * FIXED_SCALE + 0.5).astype(np.int64)


def check_fixed_range(n: int, x) -> None:
    amax = float(np.abs(x).max()) if np.size(x) else 0.0
    if not np.isfinite(amax) or (n * (amax + 1.0) * FIXED_SCALE) >= 2.0 ** 63:
        raise ValueError(f"Lloyd update: {n} vectors of max |x| {amax} overflow the int64 fixed-point sums")


def finalize_update(sums, counts, previous) -> np.ndarray:
    """Exact integer sums [K, 8] and counts [K] -> new float32 codebook; empty cells keep `previous`."""
    sums = np.asarray(sums, dtype=np.int64)
    counts = np.asarray(counts, dtype=np.int64)
    prev = np.asarray(previous, dtype=np.float32)
    nz = counts > 0
    den = np.where(nz, counts, 1).astype(np.float64) * FIXED_SCALE
    mean = (sums.astype(np.float64) / den[:, None]).astype(np.float32)
    return np.where(nz[:, None], mean, prev).astype(np.float32)


def row_gains(w) -> np.ndarray:
    """Row RMS of w [R, K] (float64), stored as f16 [R]."""
    w64 = np.asarray(w, dtype=np.float64)
    return encode_gains(np.sqrt((w64 * w64).mean(axis=1)))


def normalize_rows(w, gains_f16) -> np.ndarray:
    """w [R, 8J] / g [R] -> vectors [R*J, 8] float32 (correctly rounded division; rows with g = 0 -> 0)."""
    w = np.asarray(w, dtype=np.float32)
    g = np.asarray(gains_f16).view(np.float16).astype(np.float32)
    safe = np.where(g == 0, np.float32(1), g)
    x = w / safe[:, None]
    x[g == 0] = 0
    return np.ascontiguousarray(x.reshape(-1, DIM))


def pool_size(n_vectors: int, n_codewords: int, per_codeword: int = POOL_PER_CODEWORD) -> int:
    return int(min(n_vectors, per_codeword * n_codewords))


def assign_reference(x, prepared: PreparedCodebook) -> np.ndarray:
    """Plain NumPy statement of the assignment rule (the oracle for small tests): int32 [N]."""
    xr = round_sig12(np.asarray(x, dtype=np.float32).reshape(-1, DIM))
    d = np.broadcast_to(prepared.cnorm, (xr.shape[0], prepared.k)).astype(np.float32)
    for i in range(DIM):                                      # the fixed order i = 0..7
        d = d + xr[:, i:i + 1] * prepared.cbm2[None, :, i]
    return np.argmin(d, axis=1).astype(np.int32)             # argmin: first minimum = lowest index


# ----------------------------------------------------------------------------- Numba CPU path
@njit(inline="always", cache=True)
def _round_sig12_bits(u):
    """round_sig12 on one float32 bit pattern (uint32 -> uint32); the NumPy function above is the spec."""
    if (u & np.uint32(0x7FFFFFFF)) < _FLUSH_BITS:
        return np.uint32(0)
    lsb = (u >> np.uint32(_SIG_DROP)) & np.uint32(1)
    return (u + np.uint32((1 << (_SIG_DROP - 1)) - 1) + lsb) & np.uint32(0xFFFFFFFF ^ ((1 << _SIG_DROP) - 1))


@njit(parallel=True, cache=True, fastmath={"contract"})
def _assign_cpu(x, cbm2, cnorm, out):
    """The assignment rule, SIMD across the TILE vectors of a tile, four codewords per pass over the tile.

    Same bits as the plain statement (`assign_reference`): each d is accumulated in the fixed order i = 0..7
    from the exact products of 12-bit values, so fusing multiply and add ("contract") rounds the same sums;
    codewords are compared in increasing order with a strict <, so ties still go to the lowest index."""
    n = x.shape[0]
    k = cbm2.shape[0]
    xu = x.view(np.uint32)
    n_tiles = (n + TILE - 1) // TILE
    for t in prange(n_tiles):
        v0 = t * TILE
        m = min(TILE, n - v0)
        tile = np.zeros((DIM, TILE), dtype=np.uint32)         # [8, TILE]: SIMD runs across vectors
        for v in range(m):
            for i in range(DIM):
                tile[i, v] = _round_sig12_bits(xu[v0 + v, i])
        xs = tile.view(np.float32)
        best = np.full(TILE, np.inf, dtype=np.float32)
        bi = np.zeros(TILE, dtype=np.int32)
        c = 0
        while c + 4 <= k:                                     # four codewords per pass: x loaded once
            a0, a1, a2, a3 = cbm2[c, 0], cbm2[c, 1], cbm2[c, 2], cbm2[c, 3]
            a4, a5, a6, a7 = cbm2[c, 4], cbm2[c, 5], cbm2[c, 6], cbm2[c, 7]
            b0, b1, b2, b3 = cbm2[c + 1, 0], cbm2[c + 1, 1], cbm2[c + 1, 2], cbm2[c + 1, 3]
            b4, b5, b6, b7 = cbm2[c + 1, 4], cbm2[c + 1, 5], cbm2[c + 1, 6], cbm2[c + 1, 7]
            e0, e1, e2, e3 = cbm2[c + 2, 0], cbm2[c + 2, 1], cbm2[c + 2, 2], cbm2[c + 2, 3]
            e4, e5, e6, e7 = cbm2[c + 2, 4], cbm2[c + 2, 5], cbm2[c + 2, 6], cbm2[c + 2, 7]
            f0, f1, f2, f3 = cbm2[c + 3, 0], cbm2[c + 3, 1], cbm2[c + 3, 2], cbm2[c + 3, 3]
            f4, f5, f6, f7 = cbm2[c + 3, 4], cbm2[c + 3, 5], cbm2[c + 3, 6], cbm2[c + 3, 7]
            na, nb, ne, nf = cnorm[c], cnorm[c + 1], cnorm[c + 2], cnorm[c + 3]
            ia, ib, ie, jf = np.int32(c), np.int32(c + 1), np.int32(c + 2), np.int32(c + 3)
            for v in range(TILE):
                x0, x1, x2, x3 = xs[0, v], xs[1, v], xs[2, v], xs[3, v]
                x4, x5, x6, x7 = xs[4, v], xs[5, v], xs[6, v], xs[7, v]
                da = na + x0 * a0
                da = da + x1 * a1
                da = da + x2 * a2
                da = da + x3 * a3
                da = da + x4 * a4
                da = da + x5 * a5
                da = da + x6 * a6
                da = da + x7 * a7
                db = nb + x0 * b0
                db = db + x1 * b1
                db = db + x2 * b2
                db = db + x3 * b3
                db = db + x4 * b4
                db = db + x5 * b5
                db = db + x6 * b6
                db = db + x7 * b7
                de = ne + x0 * e0
                de = de + x1 * e1
                de = de + x2 * e2
                de = de + x3 * e3
                de = de + x4 * e4
                de = de + x5 * e5
                de = de + x6 * e6
                de = de + x7 * e7
                df = nf + x0 * f0
                df = df + x1 * f1
                df = df + x2 * f2
                df = df + x3 * f3
                df = df + x4 * f4
                df = df + x5 * f5
                df = df + x6 * f6
                df = df + x7 * f7
                b = best[v]
                j = bi[v]
                lt = da < b
                b = da if lt else b
                j = ia if lt else j
                lt = db < b
                b = db if lt else b
                j = ib if lt else j
                lt = de < b
                b = de if lt else b
                j = ie if lt else j
                lt = df < b
                b = df if lt else b
                j = jf if lt else j
                best[v] = b
                bi[v] = j
            c += 4
        while c < k:                                          # the last k % 4 codewords
            c0, c1, c2, c3 = cbm2[c, 0], cbm2[c, 1], cbm2[c, 2], cbm2[c, 3]
            c4, c5, c6, c7 = cbm2[c, 4], cbm2[c, 5], cbm2[c, 6], cbm2[c, 7]
            nc = cnorm[c]
            ci = np.int32(c)
            for v in range(TILE):
                d = nc + xs[0, v] * c0
                d = d + xs[1, v] * c1
                d = d + xs[2, v] * c2
                d = d + xs[3, v] * c3
                d = d + xs[4, v] * c4
                d = d + xs[5, v] * c5
                d = d + xs[6, v] * c6
                d = d + xs[7, v] * c7
                b = best[v]
                lt = d < b
                best[v] = d if lt else b
                bi[v] = ci if lt else bi[v]
            c += 1
        for v in range(m):
            out[v0 + v] = bi[v]


@njit(parallel=True, cache=True)
def _accumulate_cpu(x, idx, k, n_chunks):
    n = x.shape[0]
    part = np.empty((n_chunks, k, DIM), dtype=np.int64)
    pcount = np.empty((n_chunks, k), dtype=np.int64)
    for ch in prange(n_chunks):                               # one parallel region (launches are not free)
        for c in range(k):
            pcount[ch, c] = 0
            for i in range(DIM):
                part[ch, c, i] = 0
        lo = ch * n // n_chunks
        hi = (ch + 1) * n // n_chunks
        for v in range(lo, hi):
            c = idx[v]
            pcount[ch, c] += 1
            for i in range(DIM):
                part[ch, c, i] += np.int64(np.floor(np.float64(x[v, i]) * FIXED_SCALE + 0.5))
    sums = np.zeros((k, DIM), dtype=np.int64)
    counts = np.zeros(k, dtype=np.int64)
    for ch in range(n_chunks):                                # integer sums: any order is exact
        for c in range(k):
            counts[c] += pcount[ch, c]
            for i in range(DIM):
                sums[c, i] += part[ch, c, i]
    return sums, counts


@njit(parallel=True, cache=True)
def _matrix_error(w, cb, g, idx):
    rows, j = idx.shape
    sse_r = np.zeros(rows, dtype=np.float64)
    ssw_r = np.zeros(rows, dtype=np.float64)
    for r in prange(rows):
        gr = np.float32(g[r])
        se = 0.0
        sw = 0.0
        for q in range(j):
            c = idx[r, q]
            for i in range(DIM):
                wv = np.float64(w[r, q * DIM + i])
                d = wv - np.float64(gr * cb[c, i])            # the engine's float32 product
                se += d * d
                sw += wv * wv
        sse_r[r] = se
        ssw_r[r] = sw
    sse = 0.0
    ssw = 0.0
    for r in range(rows):                                    # fixed order: thread count cannot matter
        sse += sse_r[r]
        ssw += ssw_r[r]
    return sse, ssw


def matrix_error(w, codebook_f32, gains_f16, idx) -> tuple[float, float]:
    """(sum (w - w_hat)^2, sum w^2) in float64 for one matrix, w_hat = dequant_matrix(...) exactly."""
    w = np.ascontiguousarray(w, dtype=np.float32)
    g = np.ascontiguousarray(np.asarray(gains_f16).view(np.float16).astype(np.float32))
    return _matrix_error(w, np.ascontiguousarray(codebook_f32, dtype=np.float32), g,
                         np.ascontiguousarray(idx, dtype=np.int32))


class LloydBackend:
    """Where the vectors live and how assignment/update run. `put` moves vectors to the backend once;
    `assign` returns backend indices; `accumulate` returns host (sums int64 [K, 8], counts int64 [K]);
    `fetch` returns host int32 indices."""
    name = "abstract"

    def put(self, x):
        raise NotImplementedError

    def assign(self, xb, prepared: PreparedCodebook):
        raise NotImplementedError

    def accumulate(self, xb, idxb, k: int):
        raise NotImplementedError

    def fetch(self, idxb) -> np.ndarray:
        raise NotImplementedError


class CpuLloyd(LloydBackend):
    """Numba parallel CPU path. Vectors stay float32 [N, 8]; the assignment rounds them tile by tile."""
    name = "cpu"

    def put(self, x):
        return np.ascontiguousarray(np.asarray(x, dtype=np.float32).reshape(-1, DIM))

    def assign(self, xb, prepared: PreparedCodebook):
        out = np.empty(xb.shape[0], dtype=np.int32)
        if xb.shape[0]:
            _assign_cpu(xb, prepared.cbm2, prepared.cnorm, out)
        return out

    def accumulate(self, xb, idxb, k: int):
        x = xb
        check_fixed_range(x.shape[0], x)
        n_chunks = max(1, min(numba.get_num_threads(), x.shape[0] // 4096 + 1))
        return _accumulate_cpu(x, np.ascontiguousarray(idxb, dtype=np.int32), int(k), n_chunks)

    def fetch(self, idxb) -> np.ndarray:
        return np.asarray(idxb, dtype=np.int32)


@dataclass
class TrainResult:
    codebook: np.ndarray                    # float32 [K, 8], E4M3 values (what the file stores)
    codebook_f32: np.ndarray                # float32 [K, 8] before E4M3 rounding
    history: list = field(default_factory=list)   # relative distortion of the pool after each round


def relative_distortion(x, codebook, idx) -> float:
    """sum |x - c_idx|^2 / sum |x|^2 over vectors (float64, NumPy)."""
    x64 = np.asarray(x, dtype=np.float64)
    d = x64 - np.asarray(codebook, dtype=np.float64)[np.asarray(idx)]
    den = float((x64 * x64).sum())
    return float((d * d).sum()) / den if den > 0 else 0.0


def train_codebook(pool, n_codewords: int, rounds: int, backend: LloydBackend | None = None,
                   history: bool = False, on_round=None) -> TrainResult:
    """Lloyd on `pool` [N, 8]: equidistant init, `rounds` x (assign, exact update), then E4M3 rounding.
    `history` records the pool's relative distortion after each round; `on_round()` is called per round."""
    backend = backend or CpuLloyd()
    pool = np.ascontiguousarray(np.asarray(pool, dtype=np.float32).reshape(-1, DIM))
    n = pool.shape[0]
    if n == 0:
        raise ValueError("train_codebook: empty pool")
    if not np.isfinite(pool).all():
        raise ValueError("train_codebook: non-finite vector in the pool")
    check_fixed_range(n, pool)
    cb = pool[equidistant(n, n_codewords)].copy()
    xb = backend.put(pool)
    hist = []
    for _ in range(int(rounds)):
        idxb = backend.assign(xb, prepare_codebook(cb))
        sums, counts = backend.accumulate(xb, idxb, n_codewords)
        cb = finalize_update(sums, counts, cb)
        if history:
            hist.append(relative_distortion(pool, cb, backend.fetch(idxb)))
        if on_round:
            on_round()
    return TrainResult(codebook=e4m3_round(cb), codebook_f32=cb, history=hist)
