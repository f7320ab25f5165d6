"""kernels/gemv.py against ds4lib.ref.linear and ds4lib.formats.actquant."""
import numpy as np
import pytest
from numba import cuda

from ds4lib.formats.actquant import act_quant_fp4_e4m3 as ref_fp4_e4m3
from ds4lib.formats.actquant import act_quant_fp4_pow2 as ref_fp4_pow2
from ds4lib.formats.actquant import act_quant_fp8 as ref_fp8
from ds4lib.formats.floats import f32_to_bf16_bits, round_bf16
from ds4lib.ref.linear import linear_bf16, linear_f32, linear_q
from tests.kernels.tolerances import assert_matches


def _weights(rng, n, k, scale=0.05):
    w = round_bf16(rng.standard_normal((n, k)) * scale)
    return w, f32_to_bf16_bits(w)


@pytest.mark.parametrize("T,N,K", [(1, 6, 544),      # decode; ragged rows per block; one unrolled step + tail
                                   (5, 5, 96)])      # token tiles 4 + 1; K shorter than a warp step
def test_gemv_bf16_and_f32(cuda_ready, T, N, K):
    from kernels.gemv import gemv
    rng = np.random.default_rng(T * 100 + N)
    x = round_bf16(rng.standard_normal((T, K)))
    w, wb = _weights(rng, N, K)
    d_x, d_w = cuda_ready.to_device(x), cuda_ready.to_device(wb)
    assert_matches("gemv_bf16", gemv(d_x, d_w).copy_to_host(), linear_bf16(x, w))
    assert_matches("gemv_f32", gemv(d_x, d_w, out_bf16=False).copy_to_host(), linear_f32(x, w), bf16=False)
    w32 = (rng.standard_normal((N, K)) * 0.05).astype(np.float32)          # float32 weights (not BF16 values)
    assert_matches("gemv_f32", gemv(d_x, cuda_ready.to_device(w32), out_bf16=False).copy_to_host(),
                   linear_f32(x, w32), bf16=False)


@pytest.mark.parametrize("N,K", [(5, 2000),          # 2 warps per row, 2 rows per block (one ragged), a partial step
                                 (3, 4100)])         # 8 warps per row, the last step one word long
def test_gemv_split_rows(cuda_ready, N, K):
    """Rows split over several warps (few rows, as the router's): the reference's values, and a token's result
    the same bits alone (decode) as in a batch of five (prefill)."""
    from kernels.gemv import BLOCK_WARPS, gemv, split_for
    assert split_for(N, K // 4) > 1 and split_for(384, 5120 // 4) == BLOCK_WARPS   # V4.1's router: 8 warps a row
    assert split_for(8192, 1280) == 1
    rng = np.random.default_rng(N * K)
    x = round_bf16(rng.standard_normal((5, K)))
    w, wb = _weights(rng, N, K)
    d_w = cuda_ready.to_device(wb)
    batch = gemv(cuda_ready.to_device(x), d_w, out_bf16=False).copy_to_host()
    assert_matches("gemv_f32", batch, linear_f32(x, w), bf16=False)
    for t in (0, 4):
        one = gemv(cuda_ready.to_device(x[t:t + 1]), d_w, out_bf16=False).copy_to_host()
        np.testing.assert_array_equal(one[0].view(np.uint32), batch[t].view(np.uint32))


def test_gemv_grouped_is_wo_a(cuda_ready):
    """Attention's grouped wo_a: rows of group g read the g-th slice of the head outputs."""
    from kernels.gemv import gemv
    rng = np.random.default_rng(7)
    T, G, R, Kg = 1, 2, 4, 128                               # 2 groups x 4 rows, 128 inputs per group
    o = round_bf16(rng.standard_normal((T, G * Kg)))
    w, wb = _weights(rng, G * R, Kg)
    got = gemv(cuda_ready.to_device(o), cuda_ready.to_device(wb), rows_per_group=R).copy_to_host()
    want = np.concatenate([linear_bf16(o[:, g * Kg:(g + 1) * Kg], w[g * R:(g + 1) * R]) for g in range(G)], axis=1)
    assert_matches("gemv_bf16", got, want)


def test_linear_q_is_act_quant_then_gemv(cuda_ready):
    from kernels.gemv import act_quant_fp8, gemv
    rng = np.random.default_rng(3)
    x = round_bf16(rng.standard_normal((2, 128)) * 4)
    w, wb = _weights(rng, 3, 128)
    xq = act_quant_fp8(cuda_ready.to_device(x))
    assert_matches("gemv_bf16", gemv(xq, cuda_ready.to_device(wb)).copy_to_host(), linear_q(x, w, True))


def _adversarial(rng, n):
    x = round_bf16(rng.standard_normal(n) * np.exp2(rng.integers(-20, 12, n)))
    x[::7] = 0.0
    x[3::11] = -0.0
    x[5::13] *= 1e-30                          # tiny blocks: amax floors
    return x.astype(np.float32)


def test_act_quant_bit_exact(cuda_ready):
    from kernels.gemv import act_quant_fp4_e4m3, act_quant_fp4_pow2, act_quant_fp8
    rng = np.random.default_rng(11)
    x = _adversarial(rng, 2 * 96).reshape(2, 96)
    x[0, :32] = np.linspace(-448 * 2, 448 * 2, 32)          # saturation and exact grid points
    x[1, 32:48] = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5.0, -7.0]
    d_x = cuda_ready.to_device(x)
    assert_matches("act_quant", act_quant_fp8(d_x).copy_to_host(), ref_fp8(x, 32))
    assert_matches("act_quant", act_quant_fp4_pow2(d_x).copy_to_host(), ref_fp4_pow2(x, 32))
    assert_matches("act_quant", act_quant_fp4_e4m3(d_x).copy_to_host(), ref_fp4_e4m3(x, 16))
    y = x[:, :80].copy()                                    # block 16 with a half-filled last warp
    assert_matches("act_quant", act_quant_fp4_e4m3(cuda_ready.to_device(y)).copy_to_host(), ref_fp4_e4m3(y, 16))
    sign = lambda a: np.signbit(a)                          # noqa: E731 - -0 must stay -0
    np.testing.assert_array_equal(sign(act_quant_fp8(d_x).copy_to_host()), sign(ref_fp8(x, 32)))


def test_gemv_empty_and_bad_shapes(cuda_ready):
    from kernels.gemv import gemv
    assert gemv(cuda_ready.to_device(np.zeros((0, 8), np.float32)),
                cuda_ready.to_device(np.zeros((3, 8), np.uint16))).shape == (0, 3)
    with pytest.raises(ValueError):
        gemv(np.zeros((1, 6), np.float32), np.zeros((2, 6), np.uint16))
    with pytest.raises(ValueError):
        gemv(np.zeros((1, 8), np.float32), np.zeros((2, 8), np.float64))


def _pow2_inverse_kernel():
    from kernels.fp8 import pow2_inverse_device

    @cuda.jit
    def k(v, s, out):
        i = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
        if i < v.shape[0]:
            out[i] = v[i] * pow2_inverse_device(s[i])
    return k


def test_pow2_inverse_gives_the_bits_of_the_division(cuda_ready):
    """The quantisers multiply by pow2_inverse_device(s) where the reference divides by s: the same bits for every
    power of two the scales take (2^-126 .. 2^126), results that are subnormal or overflow included, and v / inf."""
    rng = np.random.default_rng(5)
    k = np.repeat(np.arange(-126, 127), 4)
    s = np.ldexp(np.float32(1.0), k).astype(np.float32)
    v = (rng.standard_normal(k.size) * np.exp2(rng.integers(-40, 40, k.size))).astype(np.float32)
    v[::7] = np.float32(1.2e-38) * np.float32(1.7)         # tiny values: subnormal results for large s
    s = np.concatenate([s, np.float32([np.inf, np.inf])])
    v = np.concatenate([v, np.float32([-3.5, 0.0])])
    out = cuda_ready.to_device(np.zeros_like(v))
    _pow2_inverse_kernel()[(v.size + 127) // 128, 128](cuda_ready.to_device(v), cuda_ready.to_device(s), out)
    with np.errstate(over="ignore", under="ignore"):
        want = v / s
    np.testing.assert_array_equal(out.copy_to_host().view(np.uint32), want.view(np.uint32))
    assert (np.abs(want[want != 0]) < np.finfo(np.float32).tiny).any()   # subnormal results were exercised
