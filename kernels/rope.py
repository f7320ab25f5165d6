"""Rotary embedding on the tail of each head at given positions, forward and inverse (ds4lib.ref.rope.apply_rope).

Adjacent pairs (2i, 2i+1) of the last rd = 2 * len(freqs) dims rotate by the angle of their position:
(a, b) -> (a cos - b sin, a sin + b cos), sin negated for the inverse rotation (attention output), each
result rounded to BF16 (docs/architecture.md §5.3). The cos/sin tables are inputs, indexed by position
([P, rd/2] float32, computed on the host as the reference does: cos(float32(p) * freqs) in float32), so
the kernel is bit-exact: each product is rounded on its own (mul_rn_device, no FMA contraction).

In place by default (only the tail is touched); with a separate `out` the head dims are copied, rounded
to BF16 like the reference's output.

Shapes: T tokens, H heads (1 for a single vector per token), Dh head dim, rd rope dims, P table rows.
"""
import numpy as np
from numba import cuda

from kernels import inline_device
from kernels.bf16 import mul_rn_device, round_bf16_device
from kernels.pdl import grid_entry_device

__all__ = ["rope", "rope_pair_value_device", "rope_kernel", "SIGNATURES"]

THREADS = 128


@inline_device
def rope_pair_value_device(v, other, odd, c, s):
    """One rotated value of a pair (a, b): bf16(a c - b s) for the even element (v = a, other = b), bf16(a s + b c)
    for the odd one (v = b, other = a); each product rounded on its own. The one definition (rope_kernel, and the
    fused producers that hold a pair in two neighbouring lanes: kernels.attention's combine, kernels.rms_norm)."""
    if odd:
        return round_bf16_device(mul_rn_device(other, s) + mul_rn_device(v, c))
    return round_bf16_device(mul_rn_device(v, c) - mul_rn_device(other, s))


@cuda.jit(cache=True)
def rope_kernel(x, positions, cos, sin, inverse, first_pair, out):
    """One thread per pair (2j, 2j+1) of x [T, H, Dh], pairs j >= first_pair; pairs of the tail rotate."""
    grid_entry_device()
    half = cos.shape[1]
    n_tok, n_heads, dh = x.shape
    per_row = dh // 2 - first_pair
    i = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    if i >= n_tok * n_heads * per_row:
        return
    j = first_pair + i % per_row
    h = (i // per_row) % n_heads
    t = i // (per_row * n_heads)
    a = x[t, h, 2 * j]
    b = x[t, h, 2 * j + 1]
    p = j - (dh // 2 - half)
    if p < 0:                                            # head dims: plain copy (rounded like the reference)
        out[t, h, 2 * j] = round_bf16_device(a)
        out[t, h, 2 * j + 1] = round_bf16_device(b)
        return
    pos = positions[t]
    c = cos[pos, p]
    s = -sin[pos, p] if inverse else sin[pos, p]
    out[t, h, 2 * j] = rope_pair_value_device(a, b, False, c, s)
    out[t, h, 2 * j + 1] = rope_pair_value_device(b, a, True, c, s)


SIGNATURES = {
    "rope_kernel": "void(float32[:, :, :], int64[:], float32[:, :], float32[:, :], boolean, int64, float32[:, :, :])",
}


def rope(x, positions, cos, sin, inverse=False, out=None, stream=0):
    """x [T, Dh] or [T, H, Dh] float32; positions [T] int64; cos, sin [P, rd/2] float32 with every position
    < P. Returns `out` (x itself when out is None: in place)."""
    shape = tuple(x.shape)
    if len(shape) not in (2, 3) or x.dtype != np.float32:
        raise ValueError(f"rope: x must be float32 [T, Dh] or [T, H, Dh], got {x.dtype} {shape}")
    if tuple(cos.shape) != tuple(sin.shape) or len(cos.shape) != 2 or cos.dtype != np.float32:
        raise ValueError(f"rope: cos {cos.shape} and sin {sin.shape} must be float32 [P, rd/2]")
    if tuple(positions.shape) != (shape[0],) or positions.dtype != np.int64:
        raise ValueError(f"rope: positions must be int64 [{shape[0]}]")
    dh, half = shape[-1], cos.shape[1]
    if dh % 2 or 2 * half > dh:
        raise ValueError(f"rope: {2 * half} rope dims do not fit head dim {dh}")
    x3 = x.reshape((shape[0], 1, dh)) if len(shape) == 2 else x
    if out is None:
        out3, first_pair = x3, dh // 2 - half
        out = x
    else:
        if tuple(out.shape) != shape:
            raise ValueError(f"rope: out {out.shape} must be {shape}")
        out3, first_pair = (out.reshape((shape[0], 1, dh)) if len(shape) == 2 else out), 0
    n = x3.shape[0] * x3.shape[1] * (dh // 2 - first_pair)
    if n:
        rope_kernel[(n + THREADS - 1) // THREADS, THREADS, stream](x3, positions, cos, sin, bool(inverse),
                                                                     first_pair, out3)
    return out
