"""Dev probe (not a benchmark of record, not used by the engine): the routed experts' gate / up GEMV of one V4.1
layer at decode through a lookup table of the layer's codebook against the token's activations, in place of
kernels.vq_gemv's per-weight codebook gathers.

Why. At decode every routed expert's gate and up matrix multiplies the same activation row x. With a codebook of C
codewords of 8 weights, the dot product of codeword c with chunk j of x (inputs 8j .. 8j+7) is one number,
LUT[j, c], the same for every row of every selected expert that holds index c at chunk j. A row's sum is then one
4-byte table read a chunk, where kernels.vq_gemv reads the 8-byte codeword, converts its 8 codes and feeds them to an
MMA. The table (C x D/8 entries) is built by the tensor cores: a codeword's 8 codes are one row of an f16 MMA's A,
a chunk's 8 activation codes one column of B.

The kernel (`vq_lut_kernel`, one block of THREADS an SM): block b takes chunk range cc = b % n_cc (J / n_cc chunks,
`passes` passes of 4 chunks: one act_quant block of 32 inputs a pass) and row range b // n_cc (rows_blk rows). A pass
builds the 4 chunks' table of unscaled dot products in shared memory (f32, chunk stride LS; an MMA takes 16
codewords from each half of the codebook, A's k 0-7 and 8-15, so that all 8 of its columns are table entries and one
store instruction writes them without bank conflicts), then every thread adds to each of its ROWS_T rows' sums (in
registers across the passes) the pass's block scale times its 4 chunks' entries, reading a row's 4 indices as one
uint64 (16 bits each); the chunk stride is a constant, so a lookup is one mask or shift and one load. A thread's
words of a pass are all loaded a pass ahead (during the last pass's build and lookups). The block writes its rows'
sums of its chunk range (`part` [n_cc, R]); `vq_lut_reduce_kernel` adds the n_cc partial sums of a row in order and
applies the row gain. The same sums in the same order whatever the grid.

Layout of the probe's indices: uint64 [n_cc, passes, R], the 4 indices of a row in a pass in 16-bit fields, chunk
order from the low field (2 bytes an index: the file's 13-bit layers hold 1.625, so the probe reads 23 % more).

    python bench/dev/vq_lut.py [--bits 13|12] [--cc 32] [--rr 4] [--reps 64] [--bufs 8] [--small]

prints one JSON line: µs a call of the table kernel, of its builds alone and its lookups alone, of the reduction and
of both (CUDA-graph replay, the index buffers cycled so that every call reads cold), the index bytes and their GB/s,
registers, and the largest error of 64 rows against the float64 sum of the same codes. --small: tiny shapes under the
simulator.
"""
import argparse
import json
import math
import sys

import numpy as np

if __name__ == "__main__":
    sys.path.insert(0, ".")
    _ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    _ap.add_argument("--bits", type=int, default=13, choices=(12, 13))
    _ap.add_argument("--cc", type=int, default=32, help="chunk ranges (blocks along the input)")
    _ap.add_argument("--rr", type=int, default=4, help="row ranges (blocks along the output)")
    _ap.add_argument("--reps", type=int, default=64)
    _ap.add_argument("--bufs", type=int, default=8, help="index buffers cycled (cold reads)")
    _ap.add_argument("--small", action="store_true", help="tiny shapes under the simulator (a smoke run)")
    ARGS = _ap.parse_args()
    if ARGS.small:
        from bench.timing import use_simulator
        use_simulator()

from numba import cuda  # noqa: E402
from numba import float32 as nb_f32, uint16 as nb_u16, uint32 as nb_u32  # noqa: E402
from numba.cuda.core import config as _cuda_config  # noqa: E402

from ds4lib.formats.fp8 import E4M3_VALUES  # noqa: E402
from kernels import bounded_jit, inline_device  # noqa: E402
from kernels.mma import MMA_EX_WORDS, e4m3x8_to_f16x2_device, load_at_device, mma_f16_device  # noqa: E402
from kernels import SMEM_LIMIT, smem_launch  # noqa: E402  (the opt-in past 48 KB of shared memory)

SIM = bool(_cuda_config.ENABLE_CUDASIM)
WARP = 32
THREADS = 32 if SIM else 512
WARPS = THREADS // WARP
EXW = WARPS if SIM else 1
CHUNKS = 4                      # chunks of a pass: an act_quant block of 32 inputs
PAD = 8                         # floats between two chunks' tables (stores without bank conflicts)
LS = 8192 + PAD                 # a chunk's table stride, for the largest codebook (a constant: it folds into the loads)
ROWS_T = 14                     # rows a thread takes (sums in registers, index words of a pass loaded a pass ahead)
REDUCE_THREADS = 32 if SIM else 256

if SIM:
    @cuda.jit(device=True)
    def pair_f16x2_device(pair):
        """Two E4M3 codes (uint16, the first in the low byte) -> their halves in a uint32 (kernels.mma's software
        decode of a word's first pair)."""
        return e4m3x8_to_f16x2_device(np.uint64(pair))[0]
else:
    from llvmlite import ir as _ir
    from numba.core import types as _types
    from numba.core.extending import intrinsic as _intrinsic

    @_intrinsic
    def _cvt_e4m3x2(typingctx, pair):
        """cvt.rn.f16x2.e4m3x2 of a 16-bit register."""
        sig = _types.uint32(_types.uint16)

        def codegen(context, builder, signature, args):
            fnty = _ir.FunctionType(_ir.IntType(32), [_ir.IntType(16)])
            return builder.call(_ir.InlineAsm(fnty, "cvt.rn.f16x2.e4m3x2 $0, $1;", "=r,h"), args)
        return sig, codegen

    @inline_device
    def pair_f16x2_device(pair):
        """Two E4M3 codes (uint16, the first in the low byte) -> their halves in a uint32 (one conversion)."""
        return _cvt_e4m3x2(np.uint16(pair))


U32 = np.uint32


@inline_device
def _word_device(idx, base, nr, r):
    return idx[base + min(r, nr - U32(1))]


@inline_device
def _load_pass_device(idx, base, nr, tid):
    """The index words of the thread's ROWS_T rows tid + k THREADS of a pass (clamped to the last row: a row past
    it sums the last row's entries and is never stored), all issued together: they are read a pass later."""
    return (_word_device(idx, base, nr, tid), _word_device(idx, base, nr, tid + U32(THREADS)),
            _word_device(idx, base, nr, tid + U32(2 * THREADS)), _word_device(idx, base, nr, tid + U32(3 * THREADS)),
            _word_device(idx, base, nr, tid + U32(4 * THREADS)), _word_device(idx, base, nr, tid + U32(5 * THREADS)),
            _word_device(idx, base, nr, tid + U32(6 * THREADS)), _word_device(idx, base, nr, tid + U32(7 * THREADS)),
            _word_device(idx, base, nr, tid + U32(8 * THREADS)), _word_device(idx, base, nr, tid + U32(9 * THREADS)),
            _word_device(idx, base, nr, tid + U32(10 * THREADS)), _word_device(idx, base, nr, tid + U32(11 * THREADS)),
            _word_device(idx, base, nr, tid + U32(12 * THREADS)), _word_device(idx, base, nr, tid + U32(13 * THREADS)))


@inline_device
def _pass_row_device(sf, s, a, w):
    """A row's sum a + s * (its 4 chunks' table entries added in chunk order). The table holds the unscaled dot
    products: s, a power of two, scales the pass's sum exactly as it would each entry."""
    lo = U32(w & np.uint64(0xFFFFFFFF))
    hi = U32(w >> np.uint64(32))
    v = load_at_device(sf, lo & U32(0xFFFF), 0) + load_at_device(sf, lo >> U32(16), LS)
    v = v + load_at_device(sf, hi & U32(0xFFFF), 2 * LS)
    v = v + load_at_device(sf, hi >> U32(16), 3 * LS)
    return a + v * s


@inline_device
def _acc_pass_device(sf, s, acc, ws):
    """The thread's ROWS_T sums after one pass (registers: a tuple in, a tuple out)."""
    return (_pass_row_device(sf, s, acc[0], ws[0]), _pass_row_device(sf, s, acc[1], ws[1]),
            _pass_row_device(sf, s, acc[2], ws[2]), _pass_row_device(sf, s, acc[3], ws[3]),
            _pass_row_device(sf, s, acc[4], ws[4]), _pass_row_device(sf, s, acc[5], ws[5]),
            _pass_row_device(sf, s, acc[6], ws[6]), _pass_row_device(sf, s, acc[7], ws[7]),
            _pass_row_device(sf, s, acc[8], ws[8]), _pass_row_device(sf, s, acc[9], ws[9]),
            _pass_row_device(sf, s, acc[10], ws[10]), _pass_row_device(sf, s, acc[11], ws[11]),
            _pass_row_device(sf, s, acc[12], ws[12]), _pass_row_device(sf, s, acc[13], ws[13]))


@inline_device
def _store_row_device(part, out0, r, nr, a):
    if r < nr:
        part[out0 + r] = a


@bounded_jit(THREADS)
def vq_lut_kernel(cb32, n_cw, xw, xs, idx, n_rows, rows_blk, n_cc, passes, mode, part):
    """part[cc, r] = sum over the passes of the chunk range cc of xs[pass] * (sum over its 4 chunks j of codeword
    idx[r, j] . activation codes of chunk j) (module docstring). cb32: the codebook's codes as uint32 [2 C]; xw:
    uint32 [J, 4], the f16x2 of codes 2t, 2t+1 of chunk j at [j, t]; xs: float32 [J / 4] block scales; idx: uint64
    [n_cc, passes, R]; rows_blk <= ROWS_T * THREADS. `mode` (timing): 3 the kernel, 1 the tables' builds alone, 2
    the lookups alone (over whatever the table holds)."""
    tid = U32(cuda.threadIdx.x)
    lane = tid % U32(WARP)
    warp = tid // U32(WARP)
    sf = cuda.shared.array(0, nb_f32)
    su = cuda.shared.array(0, nb_u32)
    sh = cuda.shared.array(0, nb_u16)
    ex = cuda.shared.array((EXW, WARP, MMA_EX_WORDS), np.uint32)
    exl = ex[warp % U32(EXW)]
    blk = U32(cuda.blockIdx.x)
    ncc = U32(n_cc)
    nrows = U32(n_rows)
    npass = U32(passes)
    cc = blk % ncc
    row0 = (blk // ncc) * U32(rows_blk)
    nr = min(U32(rows_blk), nrows - row0)
    nxt = _load_pass_device(idx, cc * npass * nrows + row0, nr, tid)    # in flight while the codebook is staged
    ls = U32(LS)
    cbo = U32(CHUNKS * LS)                     # the codebook's first word
    for i in range(tid, U32(2 * n_cw), U32(THREADS)):
        su[cbo + i] = cb32[i]
    z = np.float32(0.0)
    acc = (z, z, z, z, z, z, z, z, z, z, z, z, z, z)
    g = lane // U32(4)
    t = lane % U32(4)
    half = U32(n_cw // 2)
    n_tiles = half // U32(16)
    # An MMA takes 16 codewords of each half of the codebook: A's row g is [codes of codeword g | codes of codeword
    # half + g], B's columns 0-3 are chunks 0-3 over k 0-7 and columns 4-7 chunks 1, 0, 3, 2 over k 8-15, so lane t
    # holds chunks k0, k0 ^ 1 of the lower codewords (t < 2) or of the upper ones (t >= 2): one store instruction
    # writes four chunks' tables (strides of 8 banks) at 8 codewords each, without bank conflicts.
    h0 = U32(2) * cbo + t                      # the lane's pair of codeword 0 among the uint16 of shared memory
    up = U32(4) * half                         # codeword half's offset among those uint16
    k0 = (U32(2) * t & U32(3)) ^ (t >> U32(1))
    st0 = k0 * ls + g + (half if t >= U32(2) else U32(0))
    st1 = (k0 ^ U32(1)) * ls + g + (half if t >= U32(2) else U32(0))
    for p in range(npass):
        rp = cc * npass + p                    # this range's pass p among all passes
        cur = nxt
        if p + U32(1) < npass:
            nxt = _load_pass_device(idx, (rp + U32(1)) * nrows + row0, nr, tid)
        cuda.syncthreads()                     # the table is free (the last pass's lookups are done)
        xb = (rp * U32(CHUNKS)) * U32(4) + t
        b0 = xw[xb + U32(4) * g] if g < U32(CHUNKS) else U32(0)
        b1 = xw[xb + U32(4) * ((g - U32(CHUNKS)) ^ U32(1))] if g >= U32(CHUNKS) else U32(0)
        for tile in range(warp, n_tiles if mode & 1 else U32(0), U32(WARPS)):
            cw = tile * U32(16)
            ha = h0 + U32(4) * (cw + g)
            a0 = pair_f16x2_device(sh[ha])
            a1 = pair_f16x2_device(sh[ha + U32(32)])
            a2 = pair_f16x2_device(sh[ha + up])
            a3 = pair_f16x2_device(sh[ha + up + U32(32)])
            c0, c1, c2, c3 = mma_f16_device(a0, a1, a2, a3, b0, b1, np.float32(0.0), np.float32(0.0),
                                            np.float32(0.0), np.float32(0.0), exl)
            sf[st0 + cw] = c0
            sf[st1 + cw] = c1
            sf[st0 + cw + U32(8)] = c2
            sf[st1 + cw + U32(8)] = c3
        cuda.syncthreads()
        if mode & 2:
            acc = _acc_pass_device(sf, xs[rp], acc, cur)
    out0 = cc * nrows + row0
    _store_row_device(part, out0, tid + U32(0 * THREADS), nr, acc[0])
    _store_row_device(part, out0, tid + U32(1 * THREADS), nr, acc[1])
    _store_row_device(part, out0, tid + U32(2 * THREADS), nr, acc[2])
    _store_row_device(part, out0, tid + U32(3 * THREADS), nr, acc[3])
    _store_row_device(part, out0, tid + U32(4 * THREADS), nr, acc[4])
    _store_row_device(part, out0, tid + U32(5 * THREADS), nr, acc[5])
    _store_row_device(part, out0, tid + U32(6 * THREADS), nr, acc[6])
    _store_row_device(part, out0, tid + U32(7 * THREADS), nr, acc[7])
    _store_row_device(part, out0, tid + U32(8 * THREADS), nr, acc[8])
    _store_row_device(part, out0, tid + U32(9 * THREADS), nr, acc[9])
    _store_row_device(part, out0, tid + U32(10 * THREADS), nr, acc[10])
    _store_row_device(part, out0, tid + U32(11 * THREADS), nr, acc[11])
    _store_row_device(part, out0, tid + U32(12 * THREADS), nr, acc[12])
    _store_row_device(part, out0, tid + U32(13 * THREADS), nr, acc[13])


@cuda.jit(cache=True)
def vq_lut_reduce_kernel(part, n_cc, n_rows, gains, out):
    """out[r] = gains[r] * (part[0, r] + part[1, r] + ... ) in chunk-range order."""
    r = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    if r >= n_rows:
        return
    a = np.float32(0.0)
    for c in range(n_cc):
        a += part[c * n_rows + r]
    out[r] = a * gains[r]


SIGNATURES = {
    "vq_lut_kernel": "void(uint32[::1], int64, uint32[::1], float32[::1], uint64[::1], int64, int64, int64, int64, "
                     "int64, float32[::1])",
    "vq_lut_reduce_kernel": "void(float32[::1], int64, int64, float32[::1], float32[::1])",
}


def geometry(n_chunks, n_rows, n_cc, n_rr):
    """(passes, rows a block) of a grid of n_cc x n_rr blocks; refused unless each range is whole passes."""
    if n_chunks % (n_cc * CHUNKS):
        raise ValueError(f"vq_lut: {n_chunks} chunks are not {n_cc} ranges of whole passes of {CHUNKS}")
    rows_blk = -(-n_rows // n_rr)
    if rows_blk > ROWS_T * THREADS:
        raise ValueError(f"vq_lut: {rows_blk} rows a block (> {ROWS_T * THREADS}): more row ranges")
    return n_chunks // (n_cc * CHUNKS), rows_blk


def smem_bytes(n_cw):
    """A block's dynamic shared memory: the pass's table and the codebook."""
    return 4 * (CHUNKS * LS + 2 * n_cw)


def vq_lut_gemv(cb32, n_cw, xw, xs, idx, n_rows, n_cc, n_rr, part, gains, out, stream=0, reduce=True, mode=3):
    """One call: the table kernel over n_cc x n_rr blocks (`mode` 0: not launched; else vq_lut_kernel's), then the
    reduction (`reduce`)."""
    if n_cw % 32 or not 0 < n_cw <= LS - PAD:
        raise ValueError(f"vq_lut: {n_cw} codewords (a multiple of 32 up to {LS - PAD} expected)")
    passes, rows_blk = geometry(xs.shape[0] * CHUNKS, n_rows, n_cc, n_rr)
    smem = smem_bytes(n_cw)
    if smem > SMEM_LIMIT:
        raise ValueError(f"vq_lut: {smem} bytes of shared memory a block (> {SMEM_LIMIT}): more row ranges")
    if mode:
        smem_launch(vq_lut_kernel, n_cc * n_rr, THREADS, stream, smem)(cb32, n_cw, xw, xs, idx, n_rows, rows_blk, n_cc, passes, mode, part)
    if reduce:
        vq_lut_reduce_kernel[-(-n_rows // REDUCE_THREADS), REDUCE_THREADS, stream](part, n_cc, n_rows, gains, out)


def make_inputs(rng, n_cw, n_chunks, n_rows, n_cc):
    """Random host inputs: codebook codes [C, 8] (no NaN codes), activation codes [J * 8] and power-of-two block
    scales [J / 4], indices [J, R] -> (codes, x_codes, scales, idx_jr)."""
    ok = np.array([c for c in range(256) if c & 0x7F != 0x7F], np.uint8)
    codes = rng.choice(ok, size=(n_cw, 8))
    x_codes = rng.choice(ok, size=n_chunks * 8)
    scales = np.exp2(rng.integers(-8, 3, n_chunks // CHUNKS)).astype(np.float32)
    idx_jr = rng.integers(0, n_cw, size=(n_chunks, n_rows), dtype=np.uint16)
    return codes, x_codes, scales, idx_jr


def device_operands(codes, x_codes, idx_jr, n_cc):
    """(cb32 [2 C], xw [J * 4], idx [n_cc * passes * R] uint64) of the host inputs, as the kernel reads them."""
    n_chunks, n_rows = idx_jr.shape
    passes = n_chunks // (n_cc * CHUNKS)
    halves = E4M3_VALUES[x_codes].astype(np.float16).view(np.uint16).astype(np.uint32)
    xw = (halves[0::2] | (halves[1::2] << np.uint32(16))).astype(np.uint32)
    grouped = idx_jr.reshape(n_cc * passes, CHUNKS, n_rows).transpose(0, 2, 1)   # [range-pass, R, 4]
    idx = np.ascontiguousarray(grouped).view(np.uint64).reshape(-1)
    return np.ascontiguousarray(codes).view(np.uint32).reshape(-1), xw, idx


def reference(codes, x_codes, scales, idx_jr, gains, rows):
    """(float64 gains[r] * sum_j scales[j // 4] * (codeword idx[j, r] . x codes of chunk j), the same sum of the
    terms' magnitudes) of `rows`: the second scales the error of an FP32 sum of those terms."""
    cv = E4M3_VALUES[codes].astype(np.float64)                  # [C, 8]
    xv = E4M3_VALUES[x_codes].astype(np.float64).reshape(-1, 8)  # [J, 8]
    sj = np.repeat(scales.astype(np.float64), CHUNKS)[None, :]
    lut, mag = (cv @ xv.T) * sj, (np.abs(cv) @ np.abs(xv).T) * sj   # [C, J]
    j = np.arange(idx_jr.shape[0])
    return (np.array([gains[r] * lut[idx_jr[:, r], j].sum() for r in rows]),
            np.array([gains[r] * mag[idx_jr[:, r], j].sum() for r in rows]))


def max_error(got, codes, x_codes, scales, idx_jr, gains, rows):
    """The largest |got - reference| of `rows` over the row's sum of magnitudes."""
    want, mag = reference(codes, x_codes, scales, idx_jr, gains, rows)
    return float(np.max(np.abs(got[rows].astype(np.float64) - want) / mag))


def _main(a):
    from bench.timing import eager_time, graph_time
    n_cw = 1 << a.bits
    n_chunks, n_rows = (32, 300) if a.small else (5120 // 8, 6 * 2 * 2304)   # V4.1: D 5120, 6 experts' w1 + w3
    n_cc, n_rr = (2, 2) if a.small else (a.cc, a.rr)
    if a.small:
        n_cw = 256
    geometry(n_chunks, n_rows, n_cc, n_rr)                      # refused before anything is made
    rng = np.random.default_rng(0)
    codes, x_codes, scales, idx_jr = make_inputs(rng, n_cw, n_chunks, n_rows, n_cc)
    gains = rng.uniform(0.5, 2.0, n_rows).astype(np.float32)
    cb32, xw, idx = device_operands(codes, x_codes, idx_jr, n_cc)
    s = cuda.stream()
    bufs = [cuda.to_device(idx, stream=s)]
    for k in range(1, 1 if a.small else a.bufs):                 # the same rows shuffled: other bytes, same work
        bufs.append(cuda.to_device(np.ascontiguousarray(idx.reshape(-1, n_rows)[:, rng.permutation(n_rows)])
                                   .reshape(-1), stream=s))
    d = dict(cb32=cuda.to_device(cb32, stream=s), xw=cuda.to_device(xw, stream=s),
             xs=cuda.to_device(scales, stream=s), gains=cuda.to_device(gains, stream=s),
             part=cuda.device_array(n_cc * n_rows, np.float32, stream=s),
             out=cuda.device_array(n_rows, np.float32, stream=s))
    it = [0]

    def call(reduce=True, mode=3):
        buf = bufs[it[0] % len(bufs)]
        it[0] += 1
        vq_lut_gemv(d["cb32"], n_cw, d["xw"], d["xs"], buf, n_rows, n_cc, n_rr, d["part"], d["gains"], d["out"],
                    stream=s, reduce=reduce, mode=mode)

    call()
    s.synchronize()
    got = d["out"].copy_to_host()
    rows = rng.choice(n_rows, min(64, n_rows), replace=False)
    err = max_error(got, codes, x_codes, scales, idx_jr, gains, rows)
    res = {}
    for name, kw in (("table", dict(reduce=False)), ("build", dict(reduce=False, mode=1)),
                     ("lookups", dict(reduce=False, mode=2)), ("reduce", dict(mode=0)), ("both", {})):
        run = lambda kw=kw: call(**kw)  # noqa: E731
        res[name] = eager_time(run, s, 1, simulator=True) if a.small else graph_time(run, s, a.reps)
    passes, rows_blk = geometry(n_chunks, n_rows, n_cc, n_rr)
    idx_bytes = n_chunks * n_rows * 2
    regs = "n/a"
    if not SIM:
        try:
            regs = next(iter(vq_lut_kernel.get_regs_per_thread().values()))
        except Exception as exc:  # noqa: BLE001  (a probe: report, do not stop)
            regs = repr(exc)
    print(json.dumps(dict(bits=a.bits, n_cw=n_cw, chunks=n_chunks, rows=n_rows, cc=n_cc, rr=n_rr, passes=passes,
                          rows_blk=rows_blk, smem=smem_bytes(n_cw), threads=THREADS, bufs=len(bufs),
                          us={k: round(v * 1e6, 2) for k, v in res.items()}, idx_mb=round(idx_bytes / 1e6, 2),
                          table_gbps=round(idx_bytes / res["table"] / 1e9, 1), regs=regs,
                          max_rel_err=err, part_mb=round(n_cc * n_rows * 4 / 1e6, 2))), flush=True)
    if not math.isfinite(err) or err > 1e-5:
        sys.exit(f"vq_lut: max relative error {err}")


if __name__ == "__main__":
    _main(ARGS)
