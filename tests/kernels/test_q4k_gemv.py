"""kernels/q4k_gemv.py against ds4lib.formats.q4k (the decode) and ds4lib.ref.linear (the products)."""
import numpy as np
import pytest
from numba import cuda                  # the simulator swaps this global inside kernels (conftest chose the mode)

from ds4lib.formats.floats import round_bf16
from ds4lib.formats.q4k import dequantize_q4k, dequantize_q8_0, quantize_q4k, quantize_q8_0
from ds4lib.ref.linear import einsum_f32, linear_f32, linear_q
from kernels.im_operand import im_stage_lane_device
from kernels.q4k_gemv import _q4k_factor_pair_hw_device, _q4k_factors_hw_device
from tests.kernels.filled import filled
from tests.kernels.tolerances import assert_matches


def _q4k(rng, n, k):
    w = rng.standard_normal((n, k)).astype(np.float32) * 0.05
    w[0, :256] = 0.0                                        # a dead super-block: all-zero bytes
    q = quantize_q4k(w)
    return q, dequantize_q4k(q)


def _q8(rng, n, k):
    q = np.ascontiguousarray(quantize_q8_0(rng.standard_normal((n, k)).astype(np.float32) * 0.05))
    return q, dequantize_q8_0(q)


@pytest.mark.parametrize("T", [1, 5])                      # decode; a 4-token tile plus a ragged tail
def test_q4k_gemv_linear_q_and_f32(cuda_ready, T):
    """q4_K rows of 3 super-blocks (one warp step of two plus a half step); linear_q and the FP32 head."""
    from kernels.q4k_gemv import q4k_gemv
    rng = np.random.default_rng(T)
    q, w = _q4k(rng, 5, 768)
    x = round_bf16(rng.standard_normal((T, 768)) * 2)
    d_x, d_q = cuda_ready.to_device(x), cuda_ready.to_device(q)
    assert_matches("gemv_bf16", q4k_gemv(d_x, d_q).copy_to_host(), linear_q(x, w, True))
    assert_matches("gemv_f32", q4k_gemv(d_x, d_q, quantize=False, out_bf16=False).copy_to_host(),
                   linear_f32(x, w), bf16=False)


def test_q4k_grouped_rows_are_wo_a(cuda_ready):
    """Attention's grouped wo_a: rows of group g read the g-th slice (einsum_f32 then BF16, no activation rule)."""
    from kernels.q4k_gemv import q4k_gemv
    rng = np.random.default_rng(7)
    G, R, Kg = 2, 3, 256
    q, w = _q4k(rng, G * R, Kg)
    o = round_bf16(rng.standard_normal((1, G * Kg)))
    got = q4k_gemv(cuda_ready.to_device(o), cuda_ready.to_device(q), quantize=False, rows_per_group=R).copy_to_host()
    want = round_bf16(einsum_f32("tgd,grd->tgr", o.reshape(1, G, Kg), w.reshape(G, R, Kg)).reshape(1, G * R))
    assert_matches("gemv_bf16", got, want)


@pytest.mark.parametrize("T", [1, 5])
def test_q8_0_fallback(cuda_ready, T):
    """Rows of 96 (not a multiple of 256) are Q8_0 in the base file."""
    from kernels.q4k_gemv import q4k_gemv
    rng = np.random.default_rng(10 + T)
    q, w = _q8(rng, 6, 96)
    x = round_bf16(rng.standard_normal((T, 96)))
    got = q4k_gemv(cuda_ready.to_device(x), cuda_ready.to_device(q), kind="q8_0").copy_to_host()
    assert_matches("gemv_bf16", got, linear_q(x, w, True))


def test_rows_decode_bit_exact(cuda_ready):
    """The embedding lookup: selected rows equal dequantize_q4k / dequantize_q8_0 bit for bit."""
    from kernels.q4k_gemv import q4k_rows
    rng = np.random.default_rng(3)
    q, w = _q4k(rng, 6, 512)
    ids = np.array([5, 0, 5, 2], np.int64)
    np.testing.assert_array_equal(q4k_rows(cuda_ready.to_device(q), cuda_ready.to_device(ids)).copy_to_host(), w[ids])
    q8, w8 = _q8(rng, 4, 64)
    ids8 = np.array([3, 1], np.int64)
    np.testing.assert_array_equal(q4k_rows(cuda_ready.to_device(q8), cuda_ready.to_device(ids8),
                                           kind="q8_0").copy_to_host(), w8[ids8])


def test_batch_rows_equal_single_token(cuda_ready):
    """A token's result does not depend on the tokens sharing the call (the 4-token kernel vs the 1-token one)."""
    from kernels.q4k_gemv import q4k_gemv
    rng = np.random.default_rng(4)
    q, _ = _q4k(rng, 3, 512)
    x = round_bf16(rng.standard_normal((3, 512)))
    d_q = cuda_ready.to_device(q)
    many = q4k_gemv(cuda_ready.to_device(x), d_q, out_bf16=False).copy_to_host()
    one = q4k_gemv(cuda_ready.to_device(x[1:2]), d_q, out_bf16=False).copy_to_host()
    np.testing.assert_array_equal(one[0], many[1])


def test_bad_arguments(cuda_ready):
    from kernels.q4k_gemv import q4k_gemv, q4k_rows
    q = cuda_ready.to_device(np.zeros((2, 144), np.uint8))
    with pytest.raises(ValueError):
        q4k_gemv(cuda_ready.to_device(np.zeros((1, 128), np.float32)), q)          # K does not fit
    with pytest.raises(ValueError):
        q4k_gemv(cuda_ready.to_device(np.zeros((1, 256), np.float32)), q, kind="q5_K")
    with pytest.raises(ValueError):
        q4k_rows(q, cuda_ready.to_device(np.zeros(1, np.int32)))


@pytest.mark.parametrize("rows,k,rpg", [(8, 256 * 3, None), (6, 512, 3), (4, 256 * 9, None), (5, 256 * 7, None)])
def test_decode_kernel_equals_the_two_step_kernel(cuda_ready, monkeypatch, rows, k, rpg):
    """With the integer tensor-core path off, a one-token call takes q4k_gemv_deep_kernel (four steps of loads in
    flight, 8-byte activation loads); it keeps the two-step kernel's lanes and FMA order, so the same bits, for any
    number of super-blocks (odd counts, tails of 1-7 steps) and for grouped rows; a non-contiguous x takes the
    two-step kernel."""
    import kernels.q4k_gemv as qk
    from kernels.q4k_gemv import WARP, WARPS_PER_BLOCK, q4k_gemv, q4k_gemv_t1_kernel
    monkeypatch.setattr(qk, "USE_IMMA", False)
    rng = np.random.default_rng(rows * k)
    q, _ = _q4k(rng, rows, k)
    groups = 1 if rpg is None else rows // rpg
    x = cuda_ready.to_device(round_bf16(rng.standard_normal((1, groups * k))))
    d_q = cuda_ready.to_device(q)
    want = cuda_ready.device_array((1, rows), np.float32)
    q4k_gemv_t1_kernel[(rows + WARPS_PER_BLOCK - 1) // WARPS_PER_BLOCK, WARP * WARPS_PER_BLOCK](
        x, d_q.view(np.uint64), rpg or rows, False, want)
    got = q4k_gemv(x, d_q, quantize=False, out_bf16=False, rows_per_group=rpg).copy_to_host()
    np.testing.assert_array_equal(got, want.copy_to_host())
    wide = cuda_ready.to_device(np.repeat(x.copy_to_host(), 2, axis=1))      # a strided [1, K] view: two-step path
    strided = q4k_gemv(wide[:, ::2], d_q, quantize=False, out_bf16=False, rows_per_group=rpg).copy_to_host()
    np.testing.assert_array_equal(strided, got)


# ---------------------------------------- the FP8 tensor-core path (FP8-grid activations where IM_FP8_MIN_* allow)
# By default every FP8-grid call takes the integer path (kernels.q4k_gemv.IM_FP8_MIN_* = 0;
# test_fp8_grid_calls_take_the_integer_path_by_default): the tests of q4k_mma put it back with the fp8_on_mma fixture
# (tests/kernels/conftest.py).
def _mma_taken(scratch):
    return any(key[0] == "mma_counters" for key in scratch)


def test_e4m3_encoder_is_exact_on_every_code(cuda_ready):
    """e4m3_encode_device gives back the code of every finite E4M3 value (normals, subnormals, both zeros)."""
    from ds4lib.formats.fp8 import e4m3_decode
    from kernels.fp8 import e4m3_encode_kernel

    codes = np.array([c for c in range(256) if c & 0x7F != 0x7F], np.uint32)     # NaN codes left out
    vals = e4m3_decode(codes.astype(np.uint8)).astype(np.float32)
    out = cuda_ready.device_array(len(codes), np.uint32)
    e4m3_encode_kernel[2, 128](cuda_ready.to_device(vals), out)
    np.testing.assert_array_equal(out.copy_to_host(), codes)


@pytest.mark.parametrize("single_slice", [False, True])
def test_mma_prefill_rows_equal_decode(cuda_ready, monkeypatch, fp8_on_mma, single_slice):
    """On the tensor-core path a token's result is the same bits whether it is decoded alone or shares a call with
    9 others (two groups of 8 tokens, the last ragged; with K split, two launches of at most MMA_PART_TOKENS tokens
    sharing one slice-partials array), with K split in slices or not, over a row tail (24 rows = 1.5 warps); and it
    is linear_q's within the reduction-order tolerance."""
    import kernels.q4k_gemv as qk
    monkeypatch.setattr(qk, "MMA_PART_TOKENS", 8)          # a split matrix takes 10 tokens in two launches
    if single_slice:
        monkeypatch.setattr(qk, "MMA_TARGET_BLOCKS", 1)
    assert qk.mma_splits(24, 3)[1] == (1 if single_slice else 3)
    rng = np.random.default_rng(21)
    q, w = _q4k(rng, 24, 256 * 3)
    x = round_bf16(rng.standard_normal((10, 256 * 3)) * 2)
    d_q = cuda_ready.to_device(q)
    scratch = {}
    many = qk.q4k_gemv(cuda_ready.to_device(x), d_q, scratch=scratch).copy_to_host()
    assert _mma_taken(scratch)
    parts = [key for key in scratch if key[0] == "mma_part"]                  # one bounded array for both launches
    assert [key[1] for key in parts] == [(1, 1, 1) if single_slice else (3, 8, 24)]
    assert qk.mma_part_bytes(24, 256 * 3, 10) == (0 if single_slice else 3 * 8 * 24 * 4)
    for t in (0, 9):
        one = qk.q4k_gemv(cuda_ready.to_device(x[t:t + 1]), d_q).copy_to_host()
        np.testing.assert_array_equal(one[0], many[t])
    assert_matches("gemv_bf16", many, linear_q(x, w, True))


@pytest.mark.parametrize("ring", [1, 2, 3])
@pytest.mark.parametrize("target", [1, 2])
def test_weight_ring_depths_give_the_same_bits(cuda_ready, monkeypatch, fp8_on_mma, ring, target):
    """The decode kernel with its weights through a ring of `ring` tiles a warp gives the bits of the default
    (MMA_RING; 0: in registers, one super-block ahead): 40 rows (a block's last warps read clamped rows) of 5
    super-blocks, in one slice (target 1) or two uneven ones (target 2: 3 + 2), so the ring wraps and its last
    refills are skipped."""
    import kernels.q4k_gemv as qk
    monkeypatch.setattr(qk, "MMA_TARGET_BLOCKS", target)
    assert qk.mma_splits(40, 5) == ((5, 1) if target == 1 else (3, 2))
    rng = np.random.default_rng(31)
    q, w = _q4k(rng, 40, 256 * 5)
    x = cuda_ready.to_device(round_bf16(rng.standard_normal((1, 256 * 5)) * 2))
    d_q = cuda_ready.to_device(q)
    scratch = {}
    want = qk.q4k_gemv(x, d_q, scratch=scratch).copy_to_host()
    assert _mma_taken(scratch)
    monkeypatch.setattr(qk, "q4k_mma_t1_kernel", qk._make_mma_kernel(True, qk.MMA_MIN_BLOCKS_T1, ring=ring))
    np.testing.assert_array_equal(qk.q4k_gemv(x, d_q).copy_to_host(), want)
    assert_matches("gemv_bf16", want, linear_q(x.copy_to_host(), w, True))


def test_ring_kernels_refuse_weights_off_16_bytes(cuda_ready, monkeypatch, fp8_on_mma):
    """The one-token ring kernels' cp.async copies read 16-byte pieces: weights at an address 8 bytes off are
    refused with a clear error on both tensor-core paths, not a fault (on a GPU; the simulator has no device
    addresses)."""
    from tests.kernels.conftest import SIMULATOR
    if SIMULATOR:
        pytest.skip("the simulator's arrays have no device addresses")
    import kernels.q4k_gemv as qk
    from kernels.q4k_gemv import q4k_gemv
    monkeypatch.setattr(qk, "q4k_mma_t1_kernel", qk._make_mma_kernel(True, qk.MMA_MIN_BLOCKS_T1, ring=2))
    monkeypatch.setattr(qk, "q4k_imma_t1_kernel", qk._make_im_kernel(True, ring=2))
    rng = np.random.default_rng(5)
    q, _ = _q4k(rng, 16, 256)
    flat = cuda_ready.device_array(q.size + 8, np.uint8)
    w = flat[8:].reshape(q.shape)
    w.copy_to_device(q)
    x = cuda_ready.to_device(rng.standard_normal((1, 256)).astype(np.float32))
    with pytest.raises(ValueError, match="16 bytes"):
        q4k_gemv(x, w)                                   # FP8 path (quantize=True; fp8_on_mma)
    with pytest.raises(ValueError, match="16 bytes"):
        q4k_gemv(x, w, quantize=False)                   # integer path (FP32 x)


def test_weight_ring_is_for_the_decode_kernel():
    import kernels.q4k_gemv as qk
    with pytest.raises(ValueError, match="decode kernel"):
        qk._make_mma_kernel(False, qk.MMA_MIN_BLOCKS, ring=2)
    with pytest.raises(ValueError, match="decode kernel"):
        qk._make_im_kernel(False, ring=2)


def test_mma_fp8_input_and_block_scales(cuda_ready, fp8_on_mma):
    """Pre-quantised activations with fp8_input=True give the bits of quantize=True on the raw values (8 tokens over
    two stages of activations in shared memory); blocks of 32
    spanning 2^-24 .. 2^12 in magnitude (subnormal codes, large scales) and an all-zero block stay exact in the
    decomposition (code * power-of-two scale), so the FP32 result is linear_f32 of the quantised x within its
    tolerance."""
    from kernels.gemv import act_quant_fp8
    from kernels.q4k_gemv import q4k_gemv
    rng = np.random.default_rng(22)
    q, w = _q4k(rng, 24, 256 * 5)                 # 8 tokens stage 4 super-blocks at a time: two stages
    x = rng.standard_normal((8, 256 * 5)).astype(np.float32)
    x *= np.exp2(rng.integers(-24, 12, size=(8, 40))).repeat(32, axis=1).astype(np.float32)
    x[1, 64:96] = 0.0
    x = round_bf16(x)
    d_x, d_q = cuda_ready.to_device(x), cuda_ready.to_device(q)
    raw = q4k_gemv(d_x, d_q, out_bf16=False).copy_to_host()
    xq = act_quant_fp8(d_x)
    scratch = {}
    pre = q4k_gemv(xq, d_q, quantize=False, fp8_input=True, out_bf16=False, scratch=scratch).copy_to_host()
    assert _mma_taken(scratch)
    np.testing.assert_array_equal(pre, raw)
    assert_matches("gemv_f32", pre, linear_f32(xq.copy_to_host(), w), bf16=False)


@pytest.mark.parametrize("n_tok,k,split", [(1, 1280, False), (1, 1280, True), (3, 256 * 9, True),
                                           (10, 1280, False)])
def test_norm_in_the_staging_equals_rms_norm_then_the_gemv(cuda_ready, monkeypatch, fp8_on_mma, n_tok, k, split):
    """q4k_gemv(x, w, norm=(nw, eps)) gives the bits of rms_norm(x, nw, eps, out_q=xq) and then the FP8-grid GEMV
    of xq: decode (V4.1's q rank 1,280: rms_norm's 5 warps played by the GEMV block's 4), K split in slices (every
    slice forms the scale from the whole row), and batched calls (10 tokens: a pass of 8 stages its 5 super-blocks
    in two chunks, the scale formed once a pass, then a pass of 2). The rows' magnitudes make the norm's sum of
    squares depend on its order (tests/kernels/test_rms_norm.py's _order_shows; rms_norm's two-pass rows are its
    test's). Without the norm weight applied, or with another eps, the bits differ (decode)."""
    import kernels.q4k_gemv as qk
    from kernels.rms_norm import rms_norm
    from tests.kernels.test_rms_norm import _order_shows
    if not split:
        monkeypatch.setattr(qk, "MMA_TARGET_BLOCKS", 1)
    assert (qk.mma_splits(24, k // 256)[1] > 1) == split
    rng = np.random.default_rng(n_tok + k)
    q, _ = _q4k(rng, 24, k)
    x = np.stack([_order_shows(rng, k)[0] for _ in range(n_tok)])
    nw = round_bf16(1 + 0.1 * rng.standard_normal(k))
    d_x, d_q, d_nw = cuda_ready.to_device(x), cuda_ready.to_device(q), cuda_ready.to_device(nw)
    xq = cuda_ready.device_array(x.shape, np.float32)
    rms_norm(d_x, d_nw, 1e-6, out_q=xq)
    want = qk.q4k_gemv(xq, d_q, quantize=False, fp8_input=True).copy_to_host()
    assert qk.norm_path("q4_K", 24, k)
    scratch = {}
    got = qk.q4k_gemv(d_x, d_q, norm=(d_nw, 1e-6), scratch=scratch).copy_to_host()
    assert _mma_taken(scratch)
    np.testing.assert_array_equal(got, want)
    if n_tok == 1 and not split:
        other = qk.q4k_gemv(d_x, d_q, norm=(d_nw, 1e12)).copy_to_host()          # about the rows' mean square
        assert not np.array_equal(other, want)
        plain = qk.q4k_gemv(d_x, d_q, norm=(cuda_ready.to_device(np.ones(k, np.float32)), 1e-6)).copy_to_host()
        assert not np.array_equal(plain, want)


def test_norm_is_refused_off_the_fp8_path(cuda_ready, monkeypatch, fp8_on_mma):
    """norm= needs linear_q on q4k_mma_kernel (every FP8-grid shape put back on it here: fp8_on_mma): refused with
    quantize=False, for Q8_0 rows, grouped rows, a norm weight of the wrong length, and a matrix the integer path takes
    (IM_FP8_MIN_* lowered to its shape; at 4,096 rows and 16 super-blocks a row, the defaults before the
    thirty-seventh session, V4.1's wq_b and the indexer's are on norm_path, a longer matrix is not). With the
    module's defaults no shape is on norm_path (test_fp8_grid_calls_take_the_integer_path_by_default)."""
    import kernels.q4k_gemv as qk
    rng = np.random.default_rng(5)
    q, _ = _q4k(rng, 8, 512)
    d_q = cuda_ready.to_device(q)
    x = cuda_ready.to_device(round_bf16(rng.standard_normal((1, 512))))
    nw = cuda_ready.to_device(np.ones(512, np.float32))
    with pytest.raises(ValueError, match="norm"):
        qk.q4k_gemv(x, d_q, quantize=False, fp8_input=True, norm=(nw, 1e-6))
    with pytest.raises(ValueError, match="norm weight"):
        qk.q4k_gemv(x, d_q, norm=(cuda_ready.to_device(np.ones(256, np.float32)), 1e-6))
    q8, _ = _q8(rng, 8, 512)
    with pytest.raises(ValueError, match="norm"):
        qk.q4k_gemv(x, cuda_ready.to_device(q8), kind="q8_0", norm=(nw, 1e-6))
    with pytest.raises(ValueError, match="norm"):
        qk.q4k_gemv(cuda_ready.to_device(np.zeros((1, 1024), np.float32)), d_q, rows_per_group=4, norm=(nw, 1e-6))
    assert not qk.norm_path("q4_K", 8, 512, 4) and not qk.norm_path("q8_0", 8, 512)
    assert qk.norm_path("q4_K", 8, 512) and qk.norm_path("q4_K", 8192, 256 * 16)
    assert qk.norm_path("q4_K", 32768, 1280) and qk.norm_path("q4_K", 8192, 1280)   # V4.1's wq_b, the indexer's
    monkeypatch.setattr(qk, "IM_FP8_MIN_ROWS", 4096)
    monkeypatch.setattr(qk, "IM_FP8_MIN_SB", 16)
    assert not qk.norm_path("q4_K", 8192, 256 * 16)            # long FP8-grid rows take the integer path
    assert qk.norm_path("q4_K", 32768, 1280) and qk.norm_path("q4_K", 8192, 1280)
    monkeypatch.setattr(qk, "IM_FP8_MIN_ROWS", 8)
    monkeypatch.setattr(qk, "IM_FP8_MIN_SB", 2)
    assert not qk.norm_path("q4_K", 8, 512)
    with pytest.raises(ValueError, match="norm"):
        qk.q4k_gemv(x, d_q, norm=(nw, 1e-6))


# ------------------------------------------------- the integer tensor-core path (FP32 / BF16 activations)
def _im_taken(scratch):
    return any(key[0] == "im_xd" for key in scratch)


@pytest.mark.parametrize("rows,k", [(24, 256 * 9), (20, 256)])
def test_imma_prefill_rows_equal_decode(cuda_ready, rows, k):
    """FP32 activations on the integer tensor-core path (q4k_imma): a token's result is the same bits decoded alone (the
    one-token kernel) or among 10 (two passes of up to 8 columns, the last ragged), with K quarters of 3, 3, 3, 0
    super-blocks (9) or one warp of four busy (1), over a tail tile (24 and 20 rows); it is linear_f32's within the
    FP32 reduction-order tolerance, and BF16 output is the rounding of the FP32 one."""
    from kernels.q4k_gemv import q4k_gemv
    rng = np.random.default_rng(rows + k)
    q, w = _q4k(rng, rows, k)
    x = (rng.standard_normal((10, k)) * 3).astype(np.float32)
    d_q = cuda_ready.to_device(q)
    scratch = {}
    many = q4k_gemv(cuda_ready.to_device(x), d_q, quantize=False, out_bf16=False, scratch=scratch).copy_to_host()
    assert _im_taken(scratch)
    for t in (0, 9):
        one = q4k_gemv(cuda_ready.to_device(x[t:t + 1]), d_q, quantize=False, out_bf16=False).copy_to_host()
        np.testing.assert_array_equal(one[0], many[t])
    assert_matches("gemv_f32", many, linear_f32(x, w), bf16=False)
    bf = q4k_gemv(cuda_ready.to_device(x), d_q, quantize=False).copy_to_host()
    np.testing.assert_array_equal(bf, round_bf16(many))


@pytest.mark.parametrize("ring", [1, 2, 3])
def test_integer_path_ring_depths_give_the_same_bits(cuda_ready, monkeypatch, ring):
    """The integer path's one-token kernel with its weights through a ring of `ring` tiles a warp gives the bits of
    the default (IM_RING; 0: IM_BATCH super-blocks' words in registers at a time): 40 rows (a tail tile)
    of 10 super-blocks, K quarters of 3, 3, 3 and 1 (the last warp's two dead steps read zeros, not the tile its
    ring still holds), so the ring wraps (depth 1 and 2) or not (3). The imma kernels on both sides: one-token
    calls take kernels.q4k_dp4a's kernel by default (USE_DP4A), which would bypass the ring."""
    import kernels.q4k_gemv as qk
    monkeypatch.setattr(qk, "USE_DP4A", False)
    rng = np.random.default_rng(41)
    q, w = _q4k(rng, 40, 256 * 10)
    x = cuda_ready.to_device((rng.standard_normal((1, 256 * 10)) * 3).astype(np.float32))
    d_q = cuda_ready.to_device(q)
    scratch = {}
    want = qk.q4k_gemv(x, d_q, quantize=False, out_bf16=False, scratch=scratch).copy_to_host()
    assert _im_taken(scratch)
    monkeypatch.setattr(qk, "q4k_imma_t1_kernel", qk._make_im_kernel(True, ring=ring))
    np.testing.assert_array_equal(qk.q4k_gemv(x, d_q, quantize=False, out_bf16=False).copy_to_host(), want)
    assert_matches("gemv_f32", want, linear_f32(x.copy_to_host(), w), bf16=False)


def test_imma_grouped_rows_and_block_scales(cuda_ready):
    """Grouped rows (wo_a: 16-row tiles inside a group) read their group's slice; blocks of 32 spanning 2^-30 ..
    2^20 in magnitude, FP32 subnormals and an all-zero block keep FP32 accuracy through the per-block power-of-two
    scale and the three digits; rows_per_group 3 (tiles across groups) is refused by the path and takes the FMA
    kernel."""
    from kernels.q4k_gemv import im_fits, q4k_gemv
    rng = np.random.default_rng(23)
    G, R, Kg = 2, 16, 512
    q, w = _q4k(rng, G * R, Kg)
    o = rng.standard_normal((2, G * Kg)).astype(np.float32)
    o *= np.exp2(rng.integers(-30, 20, size=(2, G * Kg // 32))).repeat(32, axis=1).astype(np.float32)
    o[0, 32:64] = 0.0
    o[1, 96:128] = rng.standard_normal(32).astype(np.float32) * np.float32(2.0 ** -135)      # subnormals
    scratch = {}
    got = q4k_gemv(cuda_ready.to_device(o), cuda_ready.to_device(q), quantize=False, out_bf16=False, rows_per_group=R,
                   scratch=scratch).copy_to_host()
    assert _im_taken(scratch)
    want = einsum_f32("tgd,grd->tgr", o.reshape(2, G, Kg), w.reshape(G, R, Kg)).reshape(2, G * R)
    assert_matches("gemv_f32", got, want, bf16=False)
    assert im_fits(32, 16) and im_fits(5, 5) and not im_fits(6, 3)
    scratch = {}
    q3, _ = _q4k(rng, 6, 256)
    q4k_gemv(cuda_ready.to_device(np.ascontiguousarray(o[:, :512])), cuda_ready.to_device(q3), quantize=False,
             rows_per_group=3, scratch=scratch)
    assert not _im_taken(scratch)


def test_imma_non_finite_blocks_make_their_rows_nan(cuda_ready):
    """A NaN or an infinity in a token's activations makes that token's outputs NaN on the integer path (its block
    scale is NaN); the other tokens of the call are untouched."""
    from kernels.q4k_gemv import q4k_gemv
    rng = np.random.default_rng(24)
    q, w = _q4k(rng, 16, 512)
    x = rng.standard_normal((3, 512)).astype(np.float32)
    x[0, 40] = np.inf
    x[1, 300] = np.nan
    scratch = {}
    got = q4k_gemv(cuda_ready.to_device(x), cuda_ready.to_device(q), quantize=False, out_bf16=False,
                   scratch=scratch).copy_to_host()
    assert _im_taken(scratch)
    assert np.isnan(got[:2]).all()
    assert_matches("gemv_f32", got[2:], linear_f32(x[2:], w), bf16=False)


@cuda.jit
def _im_lane_stage_kernel(x, xd, ps):
    """Thread g stages input g of the flat x as a producer holding it would (im_stage_lane_device); threads past the
    end take part in the warp's reductions with 0."""
    g = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    ok = g < x.shape[0]
    im_stage_lane_device(x[g] if ok else np.float32(0.0), g // 32, g % 32, ok, xd, ps)


def _im_staged(cuda_mod, T, kx, fill=0xFFFFFFFF):
    from kernels.im_operand import im_stage_shapes
    return filled(cuda_mod, im_stage_shapes(T, kx), fill)


def test_im_stage_lane_equals_the_staging_kernel(cuda_ready):
    """A producer's lane staging (one input a lane, a warp a block) writes q4k_im_stage_kernel's digits and (p, sum)
    bit for bit: blocks spanning 2^-30 .. 2^20, an all-zero block, FP32 subnormals, negative values (signed top
    digit); a block holding an infinity or a NaN gets p NaN in both (its digits may differ: module docstring)."""
    from kernels.q4k_gemv import im_stage
    rng = np.random.default_rng(31)
    T, kx = 2, 256
    x = rng.standard_normal((T, kx)).astype(np.float32)
    x *= np.exp2(rng.integers(-30, 20, size=(T, kx // 32))).repeat(32, axis=1).astype(np.float32)
    x[0, 32:64] = 0.0
    x[1, 96:128] = rng.standard_normal(32).astype(np.float32) * np.float32(2.0 ** -135)
    want = im_stage(cuda_ready.to_device(x), quantize=False, out=_im_staged(cuda_ready, T, kx, 0x7F7F7F7F))
    got = _im_staged(cuda_ready, T, kx)
    _im_lane_stage_kernel[(T * kx + 63) // 64, 64](cuda_ready.to_device(x.reshape(-1)), *got)
    for name, g, w in zip(("digits", "pairs"), got, want):
        np.testing.assert_array_equal(g.copy_to_host().view(np.uint32), w.copy_to_host().view(np.uint32),
                                      err_msg=name)
    x[0, 200] = np.inf
    x[1, 7] = np.nan
    want = im_stage(cuda_ready.to_device(x), quantize=False, out=_im_staged(cuda_ready, T, kx))
    got = _im_staged(cuda_ready, T, kx, 0)
    _im_lane_stage_kernel[(T * kx + 63) // 64, 64](cuda_ready.to_device(x.reshape(-1)), *got)
    p_got, p_want = got[1].copy_to_host()[0::2], want[1].copy_to_host()[0::2]
    bad = np.zeros(T * kx // 32, bool)
    bad[[200 // 32, kx // 32]] = True
    assert np.isnan(p_got[bad]).all() and np.isnan(p_want[bad]).all()
    np.testing.assert_array_equal(p_got[~bad], p_want[~bad])


def test_staged_operands_skip_the_im_staging(cuda_ready):
    """q4k_gemv(staged=...) on the integer path gives the bits of the call that stages x itself (x is then not read);
    a call that does not take the path, and operands of the wrong shape, are refused (im_path says which calls take
    it)."""
    from kernels.q4k_gemv import im_path, im_stage, q4k_gemv
    rng = np.random.default_rng(32)
    G, R, Kg = 2, 16, 512
    q, _ = _q4k(rng, G * R, Kg)
    x = rng.standard_normal((3, G * Kg)).astype(np.float32)
    d_x, d_q = cuda_ready.to_device(x), cuda_ready.to_device(q)
    assert im_path("q4_K", G * R, Kg, R, quantize=False) and not im_path("q4_K", 6, 256, 3, quantize=False)
    assert not im_path("q8_0", G * R, Kg, R, quantize=False)
    staged = im_stage(d_x, quantize=False, out=_im_staged(cuda_ready, 3, G * Kg))
    want = q4k_gemv(d_x, d_q, quantize=False, out_bf16=False, rows_per_group=R).copy_to_host()
    zeros = cuda_ready.to_device(np.zeros_like(x))
    got = q4k_gemv(zeros, d_q, quantize=False, out_bf16=False, rows_per_group=R, staged=staged).copy_to_host()
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
    with pytest.raises(ValueError, match="staged"):
        q4k_gemv(d_x[:2], d_q, quantize=False, rows_per_group=R, staged=staged)
    with pytest.raises(ValueError, match="staged"):
        q4k_gemv(d_x, d_q, quantize=False, rows_per_group=R, staged=staged[::-1])
    q3, _ = _q4k(rng, 6, 256)
    with pytest.raises(ValueError, match="integer tensor-core path"):
        q4k_gemv(cuda_ready.to_device(np.ascontiguousarray(x[:, :512])), cuda_ready.to_device(q3), quantize=False,
                 rows_per_group=3, staged=_im_staged(cuda_ready, 3, 512))


@pytest.mark.parametrize("out_bf16", [True, False])
def test_stage_out_equals_im_stage_of_the_output(cuda_ready, out_bf16):
    """A one-token integer-path call with stage_out (wo_a's grouped rows, as the engine calls it for wo_b) gives the
    output of the call without it, and the (digits, pairs) im_stage(out, quantize=True) writes, bit for bit, for 96
    rows (three blocks of 32, each staged by the second of its two 16-row blocks); twice in a row with one scratch
    (the pair tickets are put back to zero); the rows' scales differ by up to 2^15, so each block of 32 is quantised
    on its own scale. Refused: two tokens, rows not a multiple of 32, a call off the integer path, and
    operands of the wrong shape."""
    from kernels.q4k_gemv import im_stage, q4k_gemv, stage_out_path
    rng = np.random.default_rng(33 + out_bf16)
    G, R, Kg = 2, 48, 512
    w = rng.standard_normal((G * R, Kg)) * 0.05 * np.exp2(rng.integers(-8, 8, (G * R, 1)))
    q = quantize_q4k(w.astype(np.float32))
    x = rng.standard_normal((1, G * Kg)).astype(np.float32)
    d_x, d_q = cuda_ready.to_device(x), cuda_ready.to_device(q)
    assert stage_out_path("q4_K", G * R, Kg, R, quantize=False)
    assert not stage_out_path("q4_K", G * R, Kg, R, 2, quantize=False)
    assert not stage_out_path("q4_K", 48, Kg, 16, quantize=False)
    want = q4k_gemv(d_x, d_q, quantize=False, out_bf16=out_bf16, rows_per_group=R)
    want_st = im_stage(want, quantize=True, out=_im_staged(cuda_ready, 1, G * R))
    scratch = {}
    for _ in range(2):
        st = _im_staged(cuda_ready, 1, G * R, fill=0x5A5A5A5A)
        got = q4k_gemv(d_x, d_q, quantize=False, out_bf16=out_bf16, rows_per_group=R, stage_out=st, scratch=scratch)
        np.testing.assert_array_equal(got.copy_to_host().view(np.uint32), want.copy_to_host().view(np.uint32))
        for a, b in zip(st, want_st):
            np.testing.assert_array_equal(a.copy_to_host().view(np.uint32), b.copy_to_host().view(np.uint32))
    with pytest.raises(ValueError, match="stage_out"):
        q4k_gemv(cuda_ready.to_device(np.repeat(x, 2, 0)), d_q, quantize=False, rows_per_group=R,
                 stage_out=_im_staged(cuda_ready, 1, G * R))
    q48, _ = _q4k(rng, 48, Kg)
    with pytest.raises(ValueError, match="stage_out"):
        q4k_gemv(cuda_ready.to_device(np.ascontiguousarray(np.tile(x, (1, 3))[:, :3 * Kg])),
                 cuda_ready.to_device(q48), quantize=False, rows_per_group=16,
                 stage_out=_im_staged(cuda_ready, 1, 48))
    with pytest.raises(ValueError, match="stage_out"):
        q4k_gemv(d_x, d_q, quantize=False, rows_per_group=R, stage_out=_im_staged(cuda_ready, 1, 64))


def test_imma_takes_fp8_activations_of_long_matrices(cuda_ready, monkeypatch, fp8_on_mma):
    """With IM_FP8_MIN_* raised (fp8_on_mma) FP8-grid activations keep q4k_mma; lowered to a matrix's shape (at least
    IM_FP8_MIN_ROWS rows and IM_FP8_MIN_SB super-blocks a row), they take the integer path for it (linear_q: raw x
    quantised in its staging by act_quant_fp8's rule, or fp8_input): the same bits either way, a token's bits the
    same decoded alone or among 10, and linear_q's result within its tolerance (FP8-grid values are integers there
    exactly), as q4k_mma's is."""
    import kernels.q4k_gemv as qk
    from kernels.gemv import act_quant_fp8
    rng = np.random.default_rng(25)
    q, w = _q4k(rng, 32, 256 * 3)
    x = round_bf16(rng.standard_normal((10, 256 * 3)) * 2)
    x[3, :32] *= np.float32(2.0 ** -20)
    d_q = cuda_ready.to_device(q)
    scratch = {}
    short = qk.q4k_gemv(cuda_ready.to_device(x), d_q, scratch=scratch).copy_to_host()
    assert _mma_taken(scratch) and not _im_taken(scratch)
    monkeypatch.setattr(qk, "IM_FP8_MIN_ROWS", 32)
    monkeypatch.setattr(qk, "IM_FP8_MIN_SB", 3)
    scratch = {}
    raw = qk.q4k_gemv(cuda_ready.to_device(x), d_q, scratch=scratch).copy_to_host()
    assert _im_taken(scratch) and not _mma_taken(scratch)
    xq = act_quant_fp8(cuda_ready.to_device(x))
    pre = qk.q4k_gemv(xq, d_q, quantize=False, fp8_input=True).copy_to_host()
    np.testing.assert_array_equal(pre, raw)
    for t in (0, 3, 9):
        one = qk.q4k_gemv(cuda_ready.to_device(x[t:t + 1]), d_q).copy_to_host()
        np.testing.assert_array_equal(one[0], raw[t])
    assert_matches("gemv_bf16", raw, linear_q(x, w, True))
    assert_matches("gemv_bf16", short, linear_q(x, w, True))


V41_FP8_SHAPES = {"wq_a": (1280, 5120), "wq_b": (32768, 1280), "indexer wq_b": (8192, 1280),
                  "shared w2": (5120, 2304), "wkv": (512, 5120), "shared w13": (4608, 5120), "tiny": (24, 768)}


def test_fp8_grid_calls_take_the_integer_path_by_default(cuda_ready):
    """With the module's defaults (IM_FP8_MIN_ROWS = IM_FP8_MIN_SB = 0: the V4.1 decode step 3 % faster on an H100,
    BENCHMARKS.md, thirty-seventh session) every FP8-grid q4_K GEMV takes the integer path: V4.1's shapes that took
    q4k_mma before (wq_a, wq_b, the indexer's wq_b, the shared expert's w2, wkv) and those that did not (the shared
    gate / up), and a tiny matrix, for quantize=True and fp8_input=True alike, so none is on norm_path. A small
    linear_q call launches the integer path's staging and not q4k_mma, gives linear_q within its tolerance, and
    refuses norm= (it rides on q4k_mma's staging)."""
    import kernels.q4k_gemv as qk
    for name, (n, k) in V41_FP8_SHAPES.items():
        assert qk.im_path("q4_K", n, k, quantize=True), name
        assert qk.im_path("q4_K", n, k, quantize=False, fp8_input=True), name
        assert not qk.norm_path("q4_K", n, k), name
    rng = np.random.default_rng(26)
    q, w = _q4k(rng, 24, 768)
    x = round_bf16(rng.standard_normal((1, 768)) * 2)
    d_x, d_q = cuda_ready.to_device(x), cuda_ready.to_device(q)
    scratch = {}
    got = qk.q4k_gemv(d_x, d_q, scratch=scratch).copy_to_host()
    assert _im_taken(scratch) and not _mma_taken(scratch)
    assert_matches("gemv_bf16", got, linear_q(x, w, True))
    with pytest.raises(ValueError, match="norm"):
        qk.q4k_gemv(d_x, d_q, norm=(cuda_ready.to_device(np.ones(768, np.float32)), 1e-6))


@cuda.jit
def _factor_pair_kernel(h, out):
    """Thread i: header words h[i] with t = i % 4 -> the pair's four factors, then the two sub-blocks' own."""
    i = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    if i < h.shape[0]:
        t = i % 4
        a, b, c, d = _q4k_factor_pair_hw_device(h[i, 0], h[i, 1], t)
        e, f = _q4k_factors_hw_device(h[i, 0], h[i, 1], 2 * t)
        g, k = _q4k_factors_hw_device(h[i, 0], h[i, 1], 2 * t + 1)
        out[i, 0], out[i, 1], out[i, 2], out[i, 3] = a, b, c, d
        out[i, 4], out[i, 5], out[i, 6], out[i, 7] = e, f, g, k


def test_factor_pair_equals_the_factors_of_each_sub_block(cuda_ready):
    """_q4k_factor_pair_hw_device (the decode kernel's scales and mins of sub-blocks 2t and 2t + 1 at once) gives
    _q4k_factors_hw_device's values for both, on random header words (every scale byte value, both halves of each
    third, t = 0..3), bit for bit."""
    rng = np.random.default_rng(31)
    n = 1024
    h = rng.integers(0, 2**63, (n, 2), dtype=np.uint64) * np.uint64(2) + rng.integers(0, 2, (n, 2), dtype=np.uint64)
    h[:, 0] = (h[:, 0] & np.uint64(0xFFFFFFFF00000000)) | np.uint64(0x2C003C00)   # d = 1, dmin = 1/16: finite
    every = np.arange(256, dtype=np.uint64)
    h[:256, 0] = (h[:256, 0] & np.uint64(0xFFFFFFFF)) | (every * np.uint64(0x0101010100000000))
    h[256:512, 1] = every * np.uint64(0x0101010101010101)                    # every byte value in each third
    out = cuda_ready.device_array((n, 8), np.float32)
    _factor_pair_kernel[n // 128, 128](cuda_ready.to_device(h), out)
    got = out.copy_to_host()
    np.testing.assert_array_equal(got[:, :4], got[:, 4:])
    assert np.count_nonzero(got[:, :4]) > n                 # the factors are not all zero
