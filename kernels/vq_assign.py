"""Nearest-codeword assignment for 8-dimensional VQ on the device: the fused Lloyd assignment step and the
final assignment of the base quantizer (ds4lib.solvers.vq states the rule; CpuLloyd is the CPU path).

Shapes: x [N, 8] float32 (row-normalised weight vectors), cbm2 [K, 8] float32 (= -2 * round_sig12(C)),
cnorm [K] float32 (= |round_sig12(C)|^2), out [N] int32.

Fused, no distance matrix: a block of THREADS threads owns THREADS * VPT vectors; each thread keeps its VPT
vectors (rounded to 12 significant bits), running minima and argmins in registers, while the codebook
streams through shared memory in chunks of CHUNK codewords (CHUNK*8 + CHUNK floats = 18 KB). Every thread
reads the same codeword at the same time (a shared-memory broadcast). The vector width DIM = 8 and VPT are
compile-time constants, so all VPT*8 components stay in registers (the sm_90 compile test checks that the
PTX uses no local memory).

Bit-identical with the CPU path: d = cnorm[k] + x0*cbm2[k,0] + ... + x7*cbm2[k,7] in that order with exact
products (both factors have 12 significant bits), so FMA contraction changes nothing; ties go to the lowest
k because chunks and codewords are scanned in increasing order with a strict `<`.
"""
import numpy as np
from numba import cuda, float32, int32

from kernels import inline_device
from kernels.bf16 import bits_f32, f32_bits
from kernels.pdl import grid_entry_device

__all__ = ["vq_assign", "vq_assign_kernel", "round_sig12_device", "SIGNATURES", "DIM", "THREADS", "VPT",
           "CHUNK", "VECTORS_PER_BLOCK", "MAX_LAUNCH_VECTORS"]

DIM = 8
THREADS = 128
VPT = 8                                  # vectors per thread
CHUNK = 512                              # codewords per shared-memory chunk
VECTORS_PER_BLOCK = THREADS * VPT
MAX_LAUNCH_VECTORS = 1 << 26             # one launch covers at most this many vectors (32-bit index math)
_INF = np.float32(np.inf)


@inline_device
def round_sig12_device(v):
    """float32 -> 12 significant bits, ties to even; |v| < 2^-60 -> 0 (ds4lib.solvers.vq.round_sig12)."""
    u = f32_bits(v)
    if (u & np.uint32(0x7FFFFFFF)) < np.uint32(0x21800000):
        return np.float32(0.0)
    lsb = (u >> np.uint32(12)) & np.uint32(1)
    return bits_f32((u + np.uint32(0x7FF) + lsb) & np.uint32(0xFFFFF000))


@cuda.jit(cache=True)
def vq_assign_kernel(x, cbm2, cnorm, out):
    grid_entry_device()
    sh_c = cuda.shared.array((CHUNK, DIM), float32)
    sh_n = cuda.shared.array(CHUNK, float32)
    xr = cuda.local.array((VPT, DIM), float32)
    best = cuda.local.array(VPT, float32)
    arg = cuda.local.array(VPT, int32)
    tid = cuda.threadIdx.x
    n = x.shape[0]
    k_total = cbm2.shape[0]
    base = cuda.blockIdx.x * VECTORS_PER_BLOCK + tid
    for j in range(VPT):                                     # vector base + j*THREADS: coalesced per j
        v = base + j * THREADS
        for i in range(DIM):
            xr[j, i] = round_sig12_device(x[v, i]) if v < n else np.float32(0.0)
        best[j] = _INF
        arg[j] = 0
    any_valid = base < n
    for k0 in range(0, k_total, CHUNK):
        cnt = min(CHUNK, k_total - k0)
        for t in range(tid, cnt * DIM, THREADS):
            sh_c[t // DIM, t % DIM] = cbm2[k0 + t // DIM, t % DIM]
        for t in range(tid, cnt, THREADS):
            sh_n[t] = cnorm[k0 + t]
        cuda.syncthreads()
        if any_valid:
            for kk in range(cnt):
                c0 = sh_c[kk, 0]
                c1 = sh_c[kk, 1]
                c2 = sh_c[kk, 2]
                c3 = sh_c[kk, 3]
                c4 = sh_c[kk, 4]
                c5 = sh_c[kk, 5]
                c6 = sh_c[kk, 6]
                c7 = sh_c[kk, 7]
                nk = sh_n[kk]
                for j in range(VPT):
                    d = nk + xr[j, 0] * c0
                    d = d + xr[j, 1] * c1
                    d = d + xr[j, 2] * c2
                    d = d + xr[j, 3] * c3
                    d = d + xr[j, 4] * c4
                    d = d + xr[j, 5] * c5
                    d = d + xr[j, 6] * c6
                    d = d + xr[j, 7] * c7
                    if d < best[j]:
                        best[j] = d
                        arg[j] = k0 + kk
        cuda.syncthreads()
    for j in range(VPT):
        v = base + j * THREADS
        if v < n:
            out[v] = arg[j]


SIGNATURES = {"vq_assign_kernel": "void(float32[:, ::1], float32[:, ::1], float32[::1], int32[::1])"}


def vq_assign(d_x, d_cbm2, d_cnorm, out=None, stream=0):
    """x [N, 8], cbm2 [K, 8], cnorm [K] (device float32, C-contiguous) -> out [N] int32 (device)."""
    n = d_x.shape[0]
    if d_x.ndim != 2 or d_x.shape[1] != DIM or d_cbm2.ndim != 2 or d_cbm2.shape[1] != DIM:
        raise ValueError(f"vq_assign: x {d_x.shape} and codebook {d_cbm2.shape} must be [*, {DIM}]")
    if d_cnorm.shape != (d_cbm2.shape[0],) or d_cbm2.shape[0] == 0:
        raise ValueError(f"vq_assign: cnorm {d_cnorm.shape} does not match codebook {d_cbm2.shape}")
    for a in (d_x, d_cbm2, d_cnorm):
        if a.dtype != np.float32:
            raise ValueError(f"vq_assign: arrays must be float32, got {a.dtype}")
    if out is None:
        out = cuda.device_array(n, dtype=np.int32, stream=stream)
    elif out.shape != (n,) or out.dtype != np.int32:
        raise ValueError(f"vq_assign: out {out.shape} {out.dtype}, expected ({n},) int32")
    for s in range(0, n, MAX_LAUNCH_VECTORS):
        e = min(n, s + MAX_LAUNCH_VECTORS)
        grid = (e - s + VECTORS_PER_BLOCK - 1) // VECTORS_PER_BLOCK
        vq_assign_kernel[grid, THREADS, stream](d_x[s:e], d_cbm2, d_cnorm, out[s:e])
    return out
