import numpy as np
import pytest
from numba import cuda                  # the simulator swaps this global inside kernels (conftest chose the mode)

from ds4lib.formats.floats import round_bf16
from ds4lib.ref.norm import rms_norm as rms_norm_ref
from kernels.rms_norm import row_sumsq_words_device
from tests.kernels.filled import filled


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
    d_pre0 = cuda_ready.to_device(np.zeros((1, 4), np.float32))
    outs = []
    for threads in (32, 96, 128):                 # 4, 2 and 1 passes of 8 elements per thread
        out = cuda_ready.device_array(x.shape, np.float32)
        rms_norm_kernel[3, threads](d_x, d_pre0, d_w, np.float32(1e-6), out, out)     # (pre, out_q: unused)
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


NORM_ROW_KERNELS = ("rms_norm_kernel", "rms_norm_q_kernel", "hc_rms_norm_kernel", "hc_rms_norm_q_kernel",
                    "rms_norm_rope_q_kernel", "rms_norm_split_kernel", "rms_norm_q_split_kernel",
                    "hc_rms_norm_q_split_kernel", "hc_rms_norm_qv_split_kernel")
LAYER_NORM_KERNELS = ("rms_norm_q_kernel", "hc_rms_norm_q_kernel", "rms_norm_rope_q_kernel",   # every layer's
                      "rms_norm_q_split_kernel", "hc_rms_norm_q_split_kernel", "hc_rms_norm_qv_split_kernel")


def test_row_launcher_reaches_threads_max():
    """Rows longer than 6,400 elements take blocks over 800 threads (the widest that 80 registers a thread allow),
    up to THREADS_MAX; longer rows take passes."""
    from kernels import rms_norm
    assert rms_norm._threads(5120) == 640
    assert rms_norm._threads(6656) == 832
    assert rms_norm._threads(8192) == rms_norm.THREADS_MAX == 1024
    assert rms_norm._threads(20000) == rms_norm.THREADS_MAX


def test_sm90_row_kernels_fit_a_block_of_threads_max():
    """ptxas for sm_90, with the kernels' launch bounds: a block of THREADS_MAX threads fits the SM's 65,536
    registers (a warp's registers are allocated in units of 256, i.e. a thread's count rounded up to 8), and the
    norms of every layer spill nothing. Without the bounds rms_norm_kernel took 80 registers, so no row longer than
    6,400 elements could launch."""
    from kernels import rms_norm
    from tests.kernels.compile_sm90 import ptx_texts, ptxas_path, ptxas_resources
    if ptxas_path() is None:
        pytest.skip("no ptxas (CUDA toolkit) on this machine")
    names = [f"rms_norm:{k}" for k in NORM_ROW_KERNELS]
    ptx = ptx_texts(names)
    for k in NORM_ROW_KERNELS:
        assert f".maxntid {rms_norm.THREADS_MAX}, 1, 1" in ptx[f"rms_norm:{k}"], k
        r = ptxas_resources(ptx[f"rms_norm:{k}"])
        assert -(-r["registers"] // 8) * 8 * rms_norm.THREADS_MAX <= 65536, (k, r)
        if k in LAYER_NORM_KERNELS:
            assert r["spill_bytes"] == 0, (k, r)


# ------------------------------------------------------------------- fused forms: the chain's bits, not ref's
def _wide_rows(rng, rows, d):
    """BF16 rows: random ones, then (rows >= 2) a row of zeros, then (rows >= 3) a row whose magnitudes span
    2^-20 .. 2^12 element by element, with exact zeros and a run of tiny values (whole blocks at the amax floor)."""
    x = _row(rng, rows, d)
    if rows >= 2:
        x[1] = 0.0
    if rows >= 3:
        x[2] = round_bf16(rng.standard_normal(d) * np.exp2(rng.integers(-20, 12, d)))
        x[2, ::7] = 0.0
        x[2, 32:64] *= np.float32(1e-30)
    return x


def _bits(a):
    return np.ascontiguousarray(a).view(np.uint32)


@pytest.mark.parametrize("T,D", [(1, 64), (3, 96), (3, 1024)])
def test_rms_norm_with_out_q_is_rms_norm_then_act_quant(cuda_ready, T, D):
    """out bit-identical to rms_norm alone, out_q to act_quant_fp8 of it (zero row, wide dynamic range, T = 1)."""
    from kernels.gemv import act_quant_fp8
    from kernels.rms_norm import rms_norm
    rng = np.random.default_rng(10 + D)
    x = _wide_rows(rng, T, D)
    w = round_bf16(1 + 0.1 * rng.standard_normal(D))
    d_x, d_w = cuda_ready.to_device(x), cuda_ready.to_device(w)
    want = rms_norm(d_x, d_w, 1e-6)
    want_q = act_quant_fp8(want).copy_to_host()
    out_q = cuda_ready.device_array((T, D), np.float32)
    got = rms_norm(d_x, d_w, 1e-6, out_q=out_q).copy_to_host()
    np.testing.assert_array_equal(_bits(got), _bits(want.copy_to_host()))
    np.testing.assert_array_equal(_bits(out_q.copy_to_host()), _bits(want_q))


@pytest.mark.parametrize("T,D,half", [(1, 64, 8), (3, 512, 32), (1, 512, 32)])
def test_rms_norm_rope_q_is_rms_norm_then_rope_then_act_quant(cuda_ready, T, D, half):
    """The window key row's fused kernel: out bit-identical to rms_norm then rope.rope (in place, forward) at the
    rows' positions, out_q to act_quant_fp8 of that; a zero row and a wide row included; bad tables refused. One row
    takes the split kernel (a decode step's; V4.1's head of 512 with a rotated tail of 64), three one block a row."""
    from kernels.gemv import act_quant_fp8
    from kernels.rms_norm import rms_norm, rms_norm_rope_q
    from kernels.rope import rope
    rng = np.random.default_rng(40 + D)
    x = _wide_rows(rng, T, D)
    w = round_bf16(1 + 0.1 * rng.standard_normal(D))
    ang = np.outer(np.arange(50, dtype=np.float32), rng.uniform(0.01, 1, half).astype(np.float32)).astype(np.float32)
    cos, sin = cuda_ready.to_device(np.cos(ang)), cuda_ready.to_device(np.sin(ang))
    pos = cuda_ready.to_device(np.arange(37, 37 + T, dtype=np.int64))
    d_x, d_w = cuda_ready.to_device(x), cuda_ready.to_device(w)
    want = rope(rms_norm(d_x, d_w, 1e-6), pos, cos, sin)
    want_q = act_quant_fp8(want).copy_to_host()
    out, out_q = cuda_ready.device_array((T, D), np.float32), cuda_ready.device_array((T, D), np.float32)
    rms_norm_rope_q(d_x, d_w, 1e-6, pos, cos, sin, out, out_q)
    np.testing.assert_array_equal(_bits(out.copy_to_host()), _bits(want.copy_to_host()))
    np.testing.assert_array_equal(_bits(out_q.copy_to_host()), _bits(want_q))
    assert not np.array_equal(out.copy_to_host(), rms_norm(d_x, d_w, 1e-6).copy_to_host())   # the tail rotated
    with pytest.raises(ValueError, match="rms_norm_rope_q"):
        rms_norm_rope_q(d_x, d_w, 1e-6, pos, cos, cuda_ready.to_device(np.sin(ang[:, :2])), out, out_q)
    with pytest.raises(ValueError, match="rms_norm_rope_q"):
        rms_norm_rope_q(d_x, d_w, 1e-6, pos, cos, sin, out, None)


def _hc_case(rng, T, D):
    h = round_bf16(rng.standard_normal((T, 4, D)) * rng.uniform(0.5, 3, (T, 4, 1)))
    if T >= 2:
        h[1] = 0.0                                                   # a zero token: x = 0, out = 0, out_q = 0
    if T >= 3:
        h[2] = round_bf16(rng.standard_normal((4, D)) * np.exp2(rng.integers(-20, 12, (4, D))))
    pre = (1 / (1 + np.exp(-rng.standard_normal((T, 4)))) + 1e-6).astype(np.float32)   # sigmoid + hc_eps
    w = round_bf16(1 + 0.1 * rng.standard_normal(D))
    return h, pre, w


@pytest.mark.parametrize("T,D", [(1, 64), (3, 96), (3, 1024)])
def test_hc_rms_norm_is_hc_pre_then_rms_norm_then_act_quant(cuda_ready, T, D):
    from kernels.gemv import act_quant_fp8
    from kernels.hc import hc_pre
    from kernels.rms_norm import hc_rms_norm, rms_norm
    rng = np.random.default_rng(20 + D)
    h, pre, w = _hc_case(rng, T, D)
    d_h, d_pre, d_w = cuda_ready.to_device(h), cuda_ready.to_device(pre), cuda_ready.to_device(w)
    want = rms_norm(hc_pre(d_h, d_pre), d_w, 1e-6)
    want_q = act_quant_fp8(want).copy_to_host()
    want = want.copy_to_host()
    np.testing.assert_array_equal(_bits(hc_rms_norm(d_h, d_pre, d_w, 1e-6).copy_to_host()), _bits(want))
    out_q = cuda_ready.device_array((T, D), np.float32)
    got = hc_rms_norm(d_h, d_pre, d_w, 1e-6, out_q=out_q).copy_to_host()
    np.testing.assert_array_equal(_bits(got), _bits(want))
    np.testing.assert_array_equal(_bits(out_q.copy_to_host()), _bits(want_q))


def test_fused_rms_norms_over_several_passes(cuda_ready):
    """32 threads on D = 512: two passes of 8 elements a thread (the launcher takes one pass up to D = 8192, too
    long a row for the simulator), each pass's warp block quantised on its own."""
    from kernels.gemv import act_quant_fp8
    from kernels.hc import hc_pre
    from kernels.rms_norm import hc_rms_norm_kernel, hc_rms_norm_q_kernel, rms_norm_kernel, rms_norm_q_kernel
    rng = np.random.default_rng(30)
    T, D, eps = 3, 512, np.float32(1e-6)
    h, pre, w = _hc_case(rng, T, D)
    d_h, d_pre, d_w = cuda_ready.to_device(h), cuda_ready.to_device(pre), cuda_ready.to_device(w)
    d_x = hc_pre(d_h, d_pre)
    want = cuda_ready.device_array((T, D), np.float32)
    rms_norm_kernel[T, 32](d_x, d_pre, d_w, eps, want, want)             # (pre, out_q: not read / written)
    want_q = _bits(act_quant_fp8(want).copy_to_host())
    want = _bits(want.copy_to_host())
    outs = [cuda_ready.device_array((T, D), np.float32) for _ in range(5)]
    rms_norm_q_kernel[T, 32](d_x, d_pre, d_w, eps, outs[0], outs[1])
    hc_rms_norm_kernel[T, 32](d_h, d_pre, d_w, eps, outs[2], outs[2])
    hc_rms_norm_q_kernel[T, 32](d_h, d_pre, d_w, eps, outs[3], outs[4])
    got = [_bits(o.copy_to_host()) for o in outs]
    for i in (0, 2, 3):
        np.testing.assert_array_equal(got[i], want, err_msg=f"out {i}")
    for i in (1, 4):
        np.testing.assert_array_equal(got[i], want_q, err_msg=f"out_q {i}")


def _staged(cuda, T, D, fill):
    """A (halves, scales) pair for T rows of D inputs, every word set to `fill` (so that an unwritten one shows)."""
    from kernels.vq_gemv import stage_shapes
    return filled(cuda, stage_shapes(T, D), fill)


@pytest.mark.parametrize("T,D,threads", [(3, 96, None), (2, 1056, None), (1, 512, None), (3, 512, 32)])
def test_hc_rms_norm_stages_the_vq_operand_as_vq_stage(cuda_ready, T, D, threads):
    """`vq=`: out and out_q as without it, and the halves and scales bit-equal to kernels.vq_gemv.vq_stage of out_q
    (quantize=False), the staging launch it replaces: D = 96 and 1,056 pad the codewords to a multiple of 16 (4 and
    12 padded codewords, one and three whole scale blocks); 512 pads none; 32 threads on 512 take two passes. The
    cases hold a zero token (scale 1), rows spanning 2^-20 .. 2^11 (subnormal codes) and every NaN-free sign."""
    from kernels.rms_norm import hc_rms_norm, hc_rms_norm_q_kernel, hc_rms_norm_qv_kernel
    from kernels.vq_gemv import SEG_CW, mma_geometry, vq_stage
    rng = np.random.default_rng(40 + D)
    h, pre, w = _hc_case(rng, T, D)
    d_h, d_pre, d_w = cuda_ready.to_device(h), cuda_ready.to_device(pre), cuda_ready.to_device(w)
    want, want_q = cuda_ready.device_array((T, D), np.float32), cuda_ready.device_array((T, D), np.float32)
    out, out_q = cuda_ready.device_array((T, D), np.float32), cuda_ready.device_array((T, D), np.float32)
    got_vq = _staged(cuda_ready, T, D, 0xFFFFFFFF)                    # NaN scales, all-ones words
    if threads is None:
        hc_rms_norm(d_h, d_pre, d_w, 1e-6, out=want, out_q=want_q)
        hc_rms_norm(d_h, d_pre, d_w, 1e-6, out=out, out_q=out_q, vq=got_vq)
    else:
        n_cwp = mma_geometry(1, D)[2] * SEG_CW
        hc_rms_norm_q_kernel[T, threads](d_h, d_pre, d_w, np.float32(1e-6), want, want_q)
        hc_rms_norm_qv_kernel[T, threads](d_h, d_pre, d_w, np.float32(1e-6), out, out_q, *got_vq, n_cwp)
    want_vq = vq_stage(want_q, quantize=False, out=_staged(cuda_ready, T, D, 0x7F7F7F7F))
    np.testing.assert_array_equal(_bits(out.copy_to_host()), _bits(want.copy_to_host()))
    np.testing.assert_array_equal(_bits(out_q.copy_to_host()), _bits(want_q.copy_to_host()))
    for name, g, e in zip(("halves", "scales"), got_vq, want_vq):
        np.testing.assert_array_equal(g.copy_to_host().view(np.uint32), e.copy_to_host().view(np.uint32),
                                      err_msg=name)
    halves = want_vq[0].copy_to_host()
    assert (halves & 0x8000).any() and (halves & 0x7FFF).any()         # negative and nonzero codes were staged


@pytest.mark.parametrize("T,D", [(3, 96), (1, 512), (2, 1056)])
def test_hc_rms_norm_stages_the_integer_operand_as_im_stage(cuda_ready, T, D):
    """`im=` (with vq): out, out_q and the VQ staging as with vq alone, and the integer path's digits and (p, sum)
    pairs bit-equal to kernels.q4k_gemv.im_stage of out_q (quantize=False), the launch it replaces, into arrays
    filled with all-ones words (an unwritten word shows); one block a row (T = 3) and the split kernels (T = 1)."""
    from kernels.im_operand import im_stage_shapes
    from kernels.q4k_gemv import im_stage
    from kernels.rms_norm import hc_rms_norm
    rng = np.random.default_rng(60 + D)
    h, pre, w = _hc_case(rng, T, D)
    d_h, d_pre, d_w = cuda_ready.to_device(h), cuda_ready.to_device(pre), cuda_ready.to_device(w)
    outs = [cuda_ready.device_array((T, D), np.float32) for _ in range(4)]
    want_vq, got_vq = _staged(cuda_ready, T, D, 0xFFFFFFFF), _staged(cuda_ready, T, D, 0xFFFFFFFF)
    got_im = filled(cuda_ready, im_stage_shapes(T, D), 0xFFFFFFFF)
    hc_rms_norm(d_h, d_pre, d_w, 1e-6, out=outs[0], out_q=outs[1], vq=want_vq)
    hc_rms_norm(d_h, d_pre, d_w, 1e-6, out=outs[2], out_q=outs[3], vq=got_vq, im=got_im)
    want_im = im_stage(outs[1], quantize=False, out=filled(cuda_ready, im_stage_shapes(T, D), 0x7F7F7F7F))
    for i in (0, 1):
        np.testing.assert_array_equal(_bits(outs[i + 2].copy_to_host()), _bits(outs[i].copy_to_host()))
    for g, e in zip(got_vq + got_im, want_vq + want_im):
        np.testing.assert_array_equal(g.copy_to_host().view(np.uint32), e.copy_to_host().view(np.uint32))
    pairs = want_im[1].copy_to_host()
    assert np.isfinite(pairs).all() and (pairs[1::2] != 0).any()        # real blocks: finite p, nonzero sums


@pytest.mark.parametrize("T,D", [(3, 96), (1, 512), (2, 1056)])
def test_norms_stage_the_integer_operand_alone_as_im_stage(cuda_ready, T, D):
    """`im=` without vq (rms_norm: the q latent's norm; hc_rms_norm: the attention norm): out and out_q bit-equal
    to the norm without it, and the integer path's digits and (p, sum) pairs bit-equal to kernels.q4k_gemv.im_stage
    of out_q (quantize=False), the launch it replaces, into arrays of all-ones words (an unwritten word shows); one
    block a row (T > 1) and the split kernels (T = 1). Rows of wide dynamic range and a zero block included."""
    from kernels.im_operand import im_stage_shapes
    from kernels.q4k_gemv import im_stage
    from kernels.rms_norm import hc_rms_norm, rms_norm
    rng = np.random.default_rng(70 + D)
    h, pre, w = _hc_case(rng, T, D)
    x = round_bf16(rng.standard_normal((T, D)) * np.exp2(rng.integers(-12, 6, (T, D))))
    x[0, 32:64] = 0.0
    d_h, d_pre, d_w, d_x = (cuda_ready.to_device(a) for a in (h, pre, w, x))
    for name, norm in (("rms_norm", lambda **kw: rms_norm(d_x, d_w, 1e-6, **kw)),
                       ("hc_rms_norm", lambda **kw: hc_rms_norm(d_h, d_pre, d_w, 1e-6, **kw))):
        outs = [cuda_ready.device_array((T, D), np.float32) for _ in range(4)]
        got_im = filled(cuda_ready, im_stage_shapes(T, D), 0xFFFFFFFF)
        norm(out=outs[0], out_q=outs[1])
        norm(out=outs[2], out_q=outs[3], im=got_im)
        want_im = im_stage(outs[1], quantize=False, out=filled(cuda_ready, im_stage_shapes(T, D), 0x7F7F7F7F))
        for i in (0, 1):
            np.testing.assert_array_equal(_bits(outs[i + 2].copy_to_host()), _bits(outs[i].copy_to_host()),
                                          err_msg=name)
        for g, e in zip(got_im, want_im):
            np.testing.assert_array_equal(g.copy_to_host().view(np.uint32), e.copy_to_host().view(np.uint32),
                                          err_msg=name)
        pairs = want_im[1].copy_to_host()
        assert np.isfinite(pairs).all() and (pairs[1::2] != 0).any(), name   # real blocks: finite p, nonzero sums


@pytest.mark.parametrize("T,D", [(2, 96), (1, 1056)])
def test_a_row_split_over_blocks_gives_one_blocks_bits(cuda_ready, monkeypatch, T, D):
    """Rows taking the split kernels, ELEMS blocks a row (rms_norm._split: a decode step's), each storing its share
    of the elements: every output of the eight split forms (out, out_q, the VQ staging with its padded codewords, the
    integer path's staging with or without the VQ's, the window key's RoPE'd row) equals the one-block kernels', into
    outputs filled with NaN or all-ones words so that an element no block stores shows (hc_rms_norm without out_q
    keeps one block)."""
    import kernels.rms_norm as rn
    from kernels.im_operand import im_stage_shapes
    rng = np.random.default_rng(50 + D)
    h, pre, w = _hc_case(rng, T, D)
    d_h, d_pre, d_w = cuda_ready.to_device(h), cuda_ready.to_device(pre), cuda_ready.to_device(w)
    d_x = cuda_ready.to_device(round_bf16(rng.standard_normal((T, D)) * 3))
    ang = np.outer(np.arange(9, dtype=np.float32), rng.uniform(0.01, 1, 16).astype(np.float32)).astype(np.float32)
    cos, sin = cuda_ready.to_device(np.cos(ang)), cuda_ready.to_device(np.sin(ang))
    pos = cuda_ready.to_device(np.arange(5, 5 + T, dtype=np.int64))

    def run(rows_max):
        monkeypatch.setattr(rn, "SPLIT_ROWS_MAX", rows_max)
        assert rn._split(T, D) == (rn.ELEMS if rows_max else 1)
        outs = [cuda_ready.to_device(np.full((T, D), np.nan, np.float32)) for _ in range(14)]
        vq, vq2 = _staged(cuda_ready, T, D, 0xFFFFFFFF), _staged(cuda_ready, T, D, 0xFFFFFFFF)
        im, im2, im3 = (filled(cuda_ready, im_stage_shapes(T, D), 0xFFFFFFFF) for _ in range(3))
        rn.rms_norm(d_x, d_w, 1e-6, out=outs[0])
        rn.rms_norm(d_x, d_w, 1e-6, out=outs[1], out_q=outs[2])
        rn.hc_rms_norm(d_h, d_pre, d_w, 1e-6, out=outs[3])
        rn.hc_rms_norm(d_h, d_pre, d_w, 1e-6, out=outs[4], out_q=outs[5], vq=vq)
        rn.hc_rms_norm(d_h, d_pre, d_w, 1e-6, out=outs[6], out_q=outs[7], vq=vq2, im=im)
        rn.rms_norm(d_x, d_w, 1e-6, out=outs[8], out_q=outs[9], im=im2)
        rn.hc_rms_norm(d_h, d_pre, d_w, 1e-6, out=outs[10], out_q=outs[11], im=im3)
        rn.rms_norm_rope_q(d_x, d_w, 1e-6, pos, cos, sin, outs[12], outs[13])
        return [o.copy_to_host().view(np.uint32) for o in outs] + [a.copy_to_host().view(np.uint32)
                                                                   for a in vq + vq2 + im + im2 + im3]
    want, got = run(0), run(T)
    for i, (g, e) in enumerate(zip(got, want)):
        np.testing.assert_array_equal(g, e, err_msg=f"output {i}")
    assert not np.isnan(got[5].view(np.float32)).any()


def test_fused_rms_norms_refuse_bad_arguments():
    """Checked before any launch (host arrays suffice)."""
    from kernels.rms_norm import hc_rms_norm, rms_norm
    f32 = lambda *s: np.zeros(s, np.float32)                        # noqa: E731
    bad = [
        lambda: rms_norm(f32(2, 100), f32(100), 1e-6, out_q=f32(2, 100)),              # D % 32 != 0
        lambda: rms_norm(f32(2, 64), f32(64), 1e-6, out_q=f32(1, 64)),                 # out_q shape
        lambda: rms_norm(f32(2, 64), f32(64), 1e-6, out_q=np.zeros((2, 64))),          # out_q dtype
        lambda: rms_norm(np.zeros((2, 64)), f32(64), 1e-6),                            # x dtype
        lambda: rms_norm(f32(2, 64), f32(32), 1e-6),                                   # w shape
        lambda: rms_norm(f32(2, 64), f32(64), 1e-6, out=f32(2, 32)),                   # out shape
        lambda: hc_rms_norm(f32(2, 3, 64), f32(2, 3), f32(64), 1e-6),                  # 3 streams
        lambda: hc_rms_norm(f32(2, 4, 64), f32(1, 4), f32(64), 1e-6),                  # pre shape
        lambda: hc_rms_norm(f32(2, 4, 64), f32(2, 4), f32(64).astype(np.float64), 1e-6),   # w dtype
        lambda: hc_rms_norm(f32(2, 4, 96), f32(2, 4), f32(96), 1e-6, out_q=f32(2, 64)),    # out_q shape
        lambda: hc_rms_norm(f32(2, 4, 80), f32(2, 4), f32(80), 1e-6, out_q=f32(2, 80)),    # D % 32 != 0
        lambda: hc_rms_norm(f32(2, 4, 96), f32(2, 4), f32(96), 1e-6, vq=_host_staged(2, 96)),   # vq without out_q
        lambda: hc_rms_norm(f32(2, 4, 96), f32(2, 4), f32(96), 1e-6, out_q=f32(2, 96),
                            vq=_host_staged(1, 96)),                                       # vq for one row
        lambda: hc_rms_norm(f32(2, 4, 96), f32(2, 4), f32(96), 1e-6, out_q=f32(2, 96),
                            vq=_host_staged(2, 96)[::-1]),                                 # vq's arrays swapped
        lambda: hc_rms_norm(f32(2, 4, 96), f32(2, 4), f32(96), 1e-6, im=_host_im(2, 96)),      # im without out_q
        lambda: hc_rms_norm(f32(2, 4, 96), f32(2, 4), f32(96), 1e-6, out_q=f32(2, 96),
                            im=_host_im(1, 96)),                                           # im for one row
        lambda: rms_norm(f32(2, 96), f32(96), 1e-6, im=_host_im(2, 96)),               # im without out_q
        lambda: rms_norm(f32(2, 96), f32(96), 1e-6, out_q=f32(2, 96), im=_host_im(2, 64)),     # im for D = 64
        lambda: rms_norm(f32(2, 96), f32(96), 1e-6, out_q=f32(2, 96), im=_host_im(2, 96)[::-1]),   # swapped
        lambda: hc_rms_norm(f32(2, 4, 96), f32(2, 4), f32(96), 1e-6, out_q=f32(2, 96), vq=_host_staged(2, 96),
                            im=_host_im(1, 96)),                                           # im for one row
    ]
    for i, call in enumerate(bad):
        with pytest.raises(ValueError):
            call()
            pytest.fail(f"case {i} did not raise")


def _host_im(T, D):
    from kernels.im_operand import im_stage_shapes
    return tuple(np.zeros(sh, dt) for sh, dt in im_stage_shapes(T, D))


def _host_staged(T, D):
    from kernels.vq_gemv import stage_shapes
    return tuple(np.zeros(sh, dt) for sh, dt in stage_shapes(T, D))


@cuda.jit
def _sumsq_kernel(x1, d, out):
    """out[r] = row_sumsq_words_device of row r of x (x1: its float32 pairs as uint64 words), from this block."""
    sh = cuda.shared.array(32, np.float64)
    total = row_sumsq_words_device(x1, np.uint64(cuda.blockIdx.x * (d // 2)), d, sh)
    if cuda.threadIdx.x == 0:
        out[cuda.blockIdx.x] = total


def _tree_sum(v):
    """warp_tree_sum_device's lane-0 result over 32 float64 values (shuffle-down tree: off 16, 8, 4, 2, 1)."""
    v = [float(a) for a in v]
    off = 16
    while off:
        v = [v[i] + v[i + off] if i + off < 32 else v[i] for i in range(32)]
        off //= 2
    return v[0]


def _rms_norm_sumsq(row):
    """rms_norm_kernel's float64 sum of squares of one row, emulated in its order: n = _threads(D) threads, thread t
    summing elements base + m * n + t (passes, then m < 8) from 0.0; each warp's shuffle tree; the tree again over
    the warp sums (zeros past the last warp)."""
    from kernels.rms_norm import _threads
    d = row.size
    n = _threads(d)
    acc = np.zeros(n)
    for t in range(n):
        a = 0.0
        for base in range(0, d, n * 8):
            for m in range(8):
                j = base + m * n + t
                u = float(row[j]) if j < d else 0.0
                a += u * u
        acc[t] = a
    sums = [_tree_sum(acc[w * 32:(w + 1) * 32]) for w in range(n // 32)]
    return _tree_sum(sums + [0.0] * (32 - len(sums)))


def _order_shows(rng, d):
    """A BF16 row on which rms_norm's order of the float64 sum of squares gives another total than a sequential and a
    pairwise (NumPy) sum: half its values near 2^20, half near 2^-5 * sqrt(D / 256) (their squares about the total's
    float64 ulp, so where they meet the large partial sums matters); drawn until it does."""
    small = 2.0 ** -5 * np.sqrt(d / 256)
    for _ in range(100):
        big = rng.random(d) < 0.5
        row = round_bf16(rng.standard_normal(d) * np.where(big, 2.0 ** 20, small))
        total = _rms_norm_sumsq(row)
        seq = 0.0
        for v in row:
            seq += float(v) * float(v)
        if seq != total and np.sum(np.square(row.astype(np.float64))) != total:
            return row, total
    raise AssertionError("no order-sensitive row drawn")


@pytest.mark.parametrize("d", [1280, 256, 8448])          # 5 warps played by 4 / 1 warp / 32 warps, two passes
def test_row_sumsq_from_any_block_is_rms_norms_sum(cuda_ready, d):
    """row_sumsq_words_device from blocks of 1, 4 and 32 warps gives the float64 total of rms_norm_kernel's order
    (emulated) to the bit, on rows where that total depends on the order (_order_shows); and rms_norm's output is
    that total's scale applied (its kernel takes the same order)."""
    from kernels.rms_norm import rms_norm
    rng = np.random.default_rng(d)
    rows = [_order_shows(rng, d) for _ in range(2)]
    x = np.stack([r for r, _ in rows])
    want = np.array([t for _, t in rows])
    d_x = cuda_ready.to_device(x)
    x1 = d_x.reshape(2 * d).view(np.uint64)
    for threads in (32, 128, 1024):
        got = cuda_ready.device_array(2, np.float64)
        _sumsq_kernel[2, threads](x1, d, got)
        np.testing.assert_array_equal(got.copy_to_host(), want, err_msg=f"{threads} threads")
    w = round_bf16(1 + 0.1 * rng.standard_normal(d))
    var = (want / d).astype(np.float32)
    scale = (np.float32(1.0) / np.sqrt(var + np.float32(1e-6)).astype(np.float32))[:, None]
    out = rms_norm(d_x, cuda_ready.to_device(w), 1e-6).copy_to_host()
    np.testing.assert_array_equal(out, round_bf16(w * (x * scale)))
