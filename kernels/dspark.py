"""DSpark draft-head pieces on the device (ds4lib.ref.dspark, ds4lib.ref.model; docs/architecture.md §9).

Owns:
- `dspark_features`: a target layer's context feature, the BF16-rounded mean over the HC streams of the state entering
  the layer, written into its column block of the call's feature rows: out[t, col0 + d] = bf16(mean_s h[t, s, d]),
  the FP32 sum in stream order divided by S (numpy's float32 mean over the stream axis, ds4lib.ref.model.run_layer).
- `markov_add`: one draft position's logits, out[d] = base[i, d] + bias[0, d] in FP32 (ds4lib.ref.dspark.draft_tokens:
  the head's logits plus the Markov head's bias for the previous token).
- `table_rows`: rows of an FP32 table by device ids (the Markov embedding where it is not stored in q4_K / Q8_0
  blocks, which kernels.q4k_gemv.q4k_rows gathers).
Does not own: the projections (q4k_gemv), the block-format gathers (q4k_rows), the argmax (sampling), the confidence
head.

Shapes: T tokens, S streams, D hidden, F = n_targets * D feature width, B block size, V vocab.
"""
import numpy as np
from numba import cuda

from kernels.bf16 import round_bf16_device
from kernels.pdl import grid_entry_device

__all__ = ["dspark_features", "markov_add", "table_rows", "dspark_features_kernel", "markov_add_kernel",
           "table_rows_kernel", "SIGNATURES"]

THREADS = 128


@cuda.jit(cache=True)
def dspark_features_kernel(h, col0, out):
    """out[t, col0 + d] = bf16((((h[t, 0, d] + h[t, 1, d]) + ...) / S) in FP32."""
    grid_entry_device()
    n_tok, n_streams, dim = h.shape
    g = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    if g >= n_tok * dim:
        return
    t = g // dim
    d = g % dim
    s = h[t, 0, d]
    for j in range(1, n_streams):
        s += h[t, j, d]
    out[t, col0 + d] = round_bf16_device(s / np.float32(n_streams))


@cuda.jit(cache=True)
def markov_add_kernel(base, row, bias, out):
    """out[d] = base[row, d] + bias[0, d]."""
    grid_entry_device()
    d = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    if d < out.shape[0]:
        out[d] = base[row, d] + bias[0, d]


@cuda.jit(cache=True)
def table_rows_kernel(table, ids, out):
    """out[t, k] = table[ids[t], k]."""
    grid_entry_device()
    n_tok, k_len = out.shape
    g = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    if g < n_tok * k_len:
        out[g // k_len, g % k_len] = table[ids[g // k_len], g % k_len]


SIGNATURES = {
    "dspark_features_kernel": "void(float32[:, :, :], int64, float32[:, :])",
    "markov_add_kernel": "void(float32[:, :], int64, float32[:, :], float32[:])",
    "table_rows_kernel": "void(float32[:, :], int64[:], float32[:, :])",
}


def dspark_features(h, col0, out, stream=0):
    """h float32 [T, S, D] -> out float32 [T, F] columns col0 .. col0 + D - 1 (module docstring)."""
    n_tok, _, dim = tuple(h.shape)
    if h.dtype != np.float32 or out.dtype != np.float32 or len(out.shape) != 2 or out.shape[0] != n_tok \
            or not 0 <= col0 <= out.shape[1] - dim:
        raise ValueError(f"dspark_features: h {h.shape} and out {out.shape} at column {col0} disagree (float32)")
    n = n_tok * dim
    if n:
        dspark_features_kernel[(n + THREADS - 1) // THREADS, THREADS, stream](h, int(col0), out)


def markov_add(base, row, bias, out, stream=0):
    """base float32 [B, V], bias float32 [1, V] -> out float32 [V] = base[row] + bias[0]."""
    if len(base.shape) != 2 or tuple(bias.shape) != (1, base.shape[1]) or tuple(out.shape) != (base.shape[1],) \
            or not 0 <= row < base.shape[0]:
        raise ValueError(f"markov_add: base {base.shape}, bias {bias.shape}, out {out.shape}, row {row} disagree")
    n = out.shape[0]
    markov_add_kernel[(n + THREADS - 1) // THREADS, THREADS, stream](base, int(row), bias, out)


def table_rows(table, ids, out, stream=0):
    """table float32 [N, K], ids int64 [T] (device) -> out float32 [T, K]."""
    if table.dtype != np.float32 or ids.dtype != np.int64 or len(ids.shape) != 1 \
            or tuple(out.shape) != (ids.shape[0], table.shape[1]):
        raise ValueError(f"table_rows: table {table.shape} (float32), ids {ids.shape} (int64) and out {out.shape} "
                         f"disagree")
    n = out.shape[0] * out.shape[1]
    if n:
        table_rows_kernel[(n + THREADS - 1) // THREADS, THREADS, stream](table, ids, out)
