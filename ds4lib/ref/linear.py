"""Linear layers of the reference, with the official dtype boundaries (docs/architecture.md §11.3, §11.4).

Shapes: T tokens, K input features, N output features.

- `linear_q`: FP8- or FP4-weight GEMM. The activation is quantised by `act_quant_fp8` (block 32)
  when `quant_sim` is on. As in the official kernels, each 32-wide K block's dot product is formed
  exactly (float64 holds it), rounded once to FP32, and the blocks accumulate in FP32 in K order;
  the output is rounded to BF16.
- `linear_bf16`: a BF16-weight linear (F.linear in BF16): FP32 accumulation, BF16 output.
- `linear_f32`: an FP32 linear (router, ratio-2 compressor, head): FP32 in, FP32 out.

Weights arrive dequantised to float32 (exact values of the stored format).
"""
from __future__ import annotations

import numpy as np

from ds4lib.formats.actquant import act_quant_fp8
from ds4lib.formats.floats import round_bf16

__all__ = ["linear_q", "linear_bf16", "linear_f32", "matmul_f32", "einsum_f32"]


def matmul_f32(x, w_t):
    """x [.., K] @ w_t [K, N] with an FP32 result. The sum is formed in float64 and rounded once, so a
    row's result does not depend on how many rows share the call (prefill, chunked prefill and decode
    then agree exactly)."""
    return np.matmul(np.asarray(x, dtype=np.float64), np.asarray(w_t, dtype=np.float64)).astype(np.float32)


def linear_q(x, w, quant_sim: bool, block: int = 32):
    """FP8/FP4-weight linear: [T, K] x [N, K] -> BF16-valued float32 [T, N]."""
    xq = act_quant_fp8(x, block) if quant_sim else np.asarray(x, dtype=np.float32)
    T, K = xq.shape
    N = w.shape[0]
    if K % block:
        return round_bf16(matmul_f32(xq, w.T))
    nb = K // block
    xb = xq.reshape(T, nb, block).transpose(1, 0, 2).astype(np.float64)          # [nb, T, 32]
    wb = w.reshape(N, nb, block).transpose(1, 2, 0).astype(np.float64)           # [nb, 32, N]
    parts = np.matmul(xb, wb).astype(np.float32)                                 # [nb, T, N]
    acc = parts[0].copy()
    for b in range(1, nb):
        acc += parts[b]
    return round_bf16(acc)


def linear_bf16(x, w):
    return round_bf16(matmul_f32(x, w.T))


def linear_f32(x, w):
    return matmul_f32(x, w.T)


def einsum_f32(spec, *operands):
    """An einsum contraction formed in float64 and rounded once to FP32 (batch-size independent)."""
    return np.einsum(spec, *[np.asarray(o, dtype=np.float64) for o in operands]).astype(np.float32)
