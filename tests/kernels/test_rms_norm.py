import numpy as np

from ds4lib.formats.floats import round_bf16
from ds4lib.ref.norm import rms_norm as rms_norm_ref


def test_rms_norm_matches_ref(cuda_ready):
    from kernels.rms_norm import rms_norm
    rng = np.random.default_rng(0)
    for rows, d in ((1, 64), (5, 96)):          # decode row; ragged rows per block
        x = round_bf16(rng.standard_normal((rows, d)) * 3)
        w = round_bf16(1 + 0.1 * rng.standard_normal(d))
        got = rms_norm(cuda_ready.to_device(x), cuda_ready.to_device(w), 1e-20).copy_to_host()
        want = rms_norm_ref(x, w, 1e-20)
        assert np.mean(got == want) > 0.99
        np.testing.assert_allclose(got, want, rtol=2 ** -7)


def _want_f64_statistic(x, w, eps):
    """ds4lib.ref.norm.rms_norm with the kernel's statistic: the sum of squares in float64 (exact or a few float64
    ulps off, so the float32 variance rounded from it does not depend on the order; kernels/rms_norm.py) instead
    of NumPy's pairwise FP32 mean (tests/kernels/tolerances.py, "pairwise sums"); every later step is the
    reference's FP32."""
    var = (np.sum(np.square(x.astype(np.float64)), axis=-1, keepdims=True) / x.shape[-1]).astype(np.float32)
    scale = np.float32(1.0) / np.sqrt(var + np.float32(eps))
    return round_bf16(w * (x * scale))


def _row(rng, rows, d):
    """BF16 rows whose scales differ by up to 2^11 between rows."""
    return round_bf16(rng.standard_normal((rows, d)) * 3 * np.exp2(rng.integers(-6, 6, (rows, 1))))


def test_rms_norm_bit_exact_at_model_widths(cuda_ready):
    """V4.1 widths (hidden 5120, q rank 1280, kv 512, indexer 128) and a width that is no multiple of the block
    (100); T = 1 decode and a few prefill rows."""
    from kernels.rms_norm import rms_norm
    rng = np.random.default_rng(1)
    for rows, d in ((1, 5120), (3, 1280), (1, 512), (2, 128), (4, 100)):
        x = _row(rng, rows, d)
        w = round_bf16(1 + 0.1 * rng.standard_normal(d))
        got = rms_norm(cuda_ready.to_device(x), cuda_ready.to_device(w), 1e-6).copy_to_host()
        np.testing.assert_array_equal(got.view(np.uint32), _want_f64_statistic(x, w, 1e-6).view(np.uint32),
                                      err_msg=f"[{rows}, {d}]")


def test_rms_norm_does_not_depend_on_block_size(cuda_ready):
    """The block sum's tree changes with the thread count; the float64 total, and so every output bit, does not."""
    from kernels.rms_norm import rms_norm_kernel
    rng = np.random.default_rng(2)
    x = _row(rng, 3, 1000)
    w = round_bf16(1 + 0.1 * rng.standard_normal(1000))
    d_x, d_w = cuda_ready.to_device(x), cuda_ready.to_device(w)
    outs = []
    for threads in (32, 96, 128):                 # 4, 2 and 1 passes of 8 elements per thread
        out = cuda_ready.device_array(x.shape, np.float32)
        rms_norm_kernel[3, threads](d_x, d_w, np.float32(1e-6), out)
        outs.append(out.copy_to_host().view(np.uint32))
    for o in outs[1:]:
        np.testing.assert_array_equal(o, outs[0])
    np.testing.assert_array_equal(outs[0], _want_f64_statistic(x, w, 1e-6).view(np.uint32))


def test_sm90_ptx_keeps_the_row_in_registers():
    """Compiled for sm_90 without a GPU: a pass's x and w values stay in registers (no local memory), and the
    block sum uses shuffles."""
    from tests.kernels.compile_sm90 import ptx_counts
    v = ptx_counts(["rms_norm:rms_norm_kernel"], [".local", "shfl.sync"])["rms_norm:rms_norm_kernel"]
    assert v["sm90"] and v[".local"] == 0 and v["shfl.sync"] >= 10, v
