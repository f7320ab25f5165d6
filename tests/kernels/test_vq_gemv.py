"""kernels/vq_gemv.py against ds4lib.formats.vq (the decoded weight) and ds4lib.ref.linear.linear_q / ds4lib.ref.moe.

Simulator shapes are tiny (the MMA is emulated exactly there). Covered: the device layout index by index (rows
and codewords padded, w2 transposed), long rows (J = 320: twenty blocks, 3 rows padded to 16), short rows (J = 12,
padded to 16), 12- and 13-bit layers, one-pair tiles and tiles of 2 and 16 pairs (MMA columns 8..15), bit equality
between tile sizes, sidecar gains, empty experts, NaN codebooks refused, SwiGLU folded into the w2 staging (bit-equal
to kernels.moe.swiglu then the GEMV), an operand staged by x's producer (`staged=`, bit-equal to the staging launch).
"""
import numpy as np
import pytest

from ds4lib.formats.actquant import act_quant_fp8
from ds4lib.formats.floats import round_bf16
from ds4lib.formats.vq import decode_codebook, dequant_matrix, encode_codebook, index_bytes, pack_indices, plane_bytes
from ds4lib.ref.linear import linear_q
from tests.kernels.compile_sm90 import ptx_counts
from tests.kernels.tolerances import assert_matches


def _layer(rng, n_exp, rows, cols, bits):
    """A random VQ layer in the file's layout: (codes, idx [E, 3, rows, cols/8], index, plane, gains f16 [E, 3, rows])."""
    n_cw = 1 << bits
    codes = encode_codebook(rng.standard_normal((n_cw, 8)).astype(np.float32))
    n = rows * cols // 8
    idx = rng.integers(0, n_cw, (n_exp, 3, n))
    index = np.zeros((n_exp, 3, index_bytes(n)), np.uint8)
    plane = np.zeros((n_exp, 3, plane_bytes(n)), np.uint8) if bits == 13 else None
    for e in range(n_exp):
        for m in range(3):
            s, p = pack_indices(idx[e, m], bits)
            index[e, m] = s
            if plane is not None:
                plane[e, m] = p
    gains = (rng.uniform(0.5, 2.0, (n_exp, 3, rows)) * 0.05).astype(np.float16)
    return codes, idx.reshape(n_exp, 3, rows, cols // 8), index, plane, gains


def _device_layer(cuda, layer):
    from kernels.vq_gemv import vq_codebook, vq_device_layout
    codes, idx, index, plane, gains = layer
    shape = (idx.shape[2], idx.shape[3] * 8)
    d_index, d_plane = vq_device_layout(cuda.to_device(index), None if plane is None else cuda.to_device(plane),
                                        shape, shape)
    return (vq_codebook(cuda.to_device(codes)), d_index, d_plane,
            tuple(cuda.to_device(np.ascontiguousarray(gains[:, m]).view(np.uint16)) for m in range(3)))


def _want(layer, m, x_rows, experts, scale=None):
    """linear_q(x_p, dequant_matrix(...) [* scale]) for each pair p (reference: W = g * C[idx], then the sidecar)."""
    codes, idx, _, _, gains = layer
    cb = decode_codebook(codes)
    out = []
    for x, e in zip(x_rows, experts):
        w = dequant_matrix(cb, gains[e, m], idx[e, m])
        if scale is not None:
            w = w * scale[e][:, None]
        out.append(linear_q(x[None], w, True)[0])
    return np.stack(out)


def _device_indices(index, plane, rows, cols):
    """The device layout read back on the host, straight from its definition (kernels.vq_gemv): block rg*n_seg + s,
    lane 4n + t, position k = codeword 16s + 4(k // 2) + t of row 16rg + n + 8(k % 2), its low byte byte k % 4 of
    word k // 4, its high nibble at bit 8(k % 4) + 4(k // 4) of the third word, bit 12 bit k of the plane byte ->
    idx [rows16, cols16/8] with the padding."""
    J = cols // 8
    n_rg, n_seg = -(-rows // 16), -(-J // 16)
    words = index.view(np.uint32)
    out = np.zeros((n_rg * 16, n_seg * 16), np.int64)
    for rg in range(n_rg):
        for s in range(n_seg):
            b = rg * n_seg + s
            for lane in range(32):
                w0, w1, w2 = (int(words[96 * b + 32 * i + lane]) for i in range(3))
                pl = int(plane[32 * b + lane]) if plane is not None else 0
                for k in range(8):
                    lo = ((w0 if k < 4 else w1) >> (8 * (k % 4))) & 0xFF
                    v = lo | (((w2 >> (8 * (k % 4) + 4 * (k // 4))) & 0xF) << 8) | (((pl >> k) & 1) << 12)
                    out[16 * rg + lane // 4 + 8 * (k % 2), 16 * s + 4 * (k // 2) + lane % 4] = v
    return out


def test_codebook_words_and_nan_codes_refused(cuda_ready):
    """The codebook reaches the kernel as its own bytes, 8 codes a word; a NaN code is refused at load."""
    from kernels.vq_gemv import vq_codebook
    rng = np.random.default_rng(11)
    codes = encode_codebook(rng.standard_normal((4096, 8)).astype(np.float32))
    got = vq_codebook(cuda_ready.to_device(codes)).copy_to_host()
    np.testing.assert_array_equal(got.view(np.uint8).reshape(4096, 8), codes)
    codes[17, 3] = 0xFF
    with pytest.raises(ValueError, match="NaN"):
        vq_codebook(cuda_ready.to_device(codes))


def test_e4m3_words_of_eight_codes_become_four_pairs_of_halves(cuda_ready):
    """e4m3x8_to_f16x2_device (the GEMV's codewords, the staging's activation codes): codes 2i and 2i + 1 of a
    uint64 -> word i, the halves of their exact values, for every finite code in every byte and beside varied
    partners (the hardware cvt.rn.f16x2.e4m3x2 on the GPU; in the simulator the software decoder and the stage
    kernel's float -> half step, f16_of_e4m3_value_device, through the same values)."""
    from ds4lib.formats.fp8 import e4m3_decode
    from kernels.mma import e4m3x8_to_f16_kernel
    rng = np.random.default_rng(5)
    finite = np.array([c for c in range(256) if c & 0x7F != 0x7F], np.uint8)
    codes = np.stack([np.roll(finite, 31 * j) for j in range(8)], axis=1)          # every code in every byte
    codes = np.concatenate([codes, rng.choice(finite, (200, 8))])
    words = codes.copy().view(np.uint64).reshape(-1)
    out = cuda_ready.device_array(4 * len(words), np.uint32)
    e4m3x8_to_f16_kernel[4, 128](cuda_ready.to_device(words), out)
    half = e4m3_decode(codes).astype(np.float16).view(np.uint16).astype(np.uint32)
    want = half[:, 0::2] | (half[:, 1::2] << 16)
    np.testing.assert_array_equal(out.copy_to_host().reshape(-1, 4), want)


def test_byte_permutation_selects_bytes_of_the_word_pair(cuda_ready):
    """byte_perm_device (prmt.b32, default mode): byte i of the result is byte (sel >> 4i) & 7 of (b, a), a first;
    the GEMV's selectors (0x5140, 0x7362, 0x4410) and random ones."""
    from kernels.mma import byte_perm_kernel
    rng = np.random.default_rng(9)
    n = 300
    a = rng.integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32)
    b = rng.integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32)
    sel = rng.integers(0, 8, (n, 4)) @ (16 ** np.arange(4))
    sel[:3] = (0x5140, 0x7362, 0x4410)
    sel = sel.astype(np.uint32)
    out = cuda_ready.device_array(n, np.uint32)
    byte_perm_kernel[3, 128](*(cuda_ready.to_device(v) for v in (a, b, sel)), out)
    pair = np.stack([a.view(np.uint8).reshape(n, 4), b.view(np.uint8).reshape(n, 4)], axis=1).reshape(n, 8)
    pick = (sel[:, None] >> (4 * np.arange(4, dtype=np.uint32))) & 7
    want = np.take_along_axis(pair, pick.astype(np.int64), axis=1).copy().view(np.uint32).reshape(n)
    np.testing.assert_array_equal(out.copy_to_host(), want)


@pytest.mark.parametrize("rows, cols, w2_shape, bits", [(3, 96, (3, 96), 12), (64, 96, (96, 64), 12),
                                                       (24, 2560, (24, 2560), 13), (192, 256, (256, 192), 13)])
def test_device_layout_places_every_index(cuda_ready, rows, cols, w2_shape, bits):
    """vq_device_layout moves each index of the file's stream to its place in the device layout (read back by the
    definition above) and pads rows and codewords to 16 with index 0; w2 as the tests' other matrices or
    transposed as in the engine (the last: ds4-tiny's shapes, its w2 rows padded from 24 codewords to 32)."""
    from kernels.vq_gemv import device_stream_bytes, vq_device_layout
    rng = np.random.default_rng(rows + cols)
    n_exp = 2
    codes, idx, index, plane, gains = _layer(rng, n_exp, rows, cols, bits)
    got_i, got_p = vq_device_layout(cuda_ready.to_device(index), None if plane is None else cuda_ready.to_device(plane),
                                    (rows, cols), w2_shape)
    s_len, p_len = device_stream_bytes((rows, cols), w2_shape)
    assert got_i.shape == (n_exp, 3, s_len) and (got_p is None) == (bits == 12)
    gi, gp = got_i.copy_to_host(), None if got_p is None else got_p.copy_to_host()
    assert gp is None or gp.shape == (n_exp, 3, p_len)
    for e in range(n_exp):
        for m in range(3):
            r, c = w2_shape if m == 1 else (rows, cols)
            flat = idx[e, m].reshape(-1)                         # the file's positions p = row * J + codeword
            dev = _device_indices(gi[e, m], None if gp is None else gp[e, m], r, c)
            want = np.zeros_like(dev)
            want[:r, :c // 8] = flat.reshape(r, c // 8)
            np.testing.assert_array_equal(dev, want)


def test_long_rows_13bit_decode_with_sidecar(cuda_ready):
    """J = 320 (20 blocks), 3 rows padded to a group of 16, one pair per tile; w1/w3 read the token, w2 each
    pair's own row with the sidecar gains."""
    from kernels.vq_gemv import vq_gemv, vq_plan
    rng = np.random.default_rng(0)
    n_exp, rows, cols = 3, 3, 2560
    layer = _layer(rng, n_exp, rows, cols, 13)
    dl = _device_layer(cuda_ready, layer)
    ids = np.array([[2, 0]], np.int32)                          # expert 1 is empty
    plan = vq_plan(cuda_ready.to_device(ids), n_exp)
    x = act_quant_fp8(round_bf16(rng.standard_normal((1, cols)) * 3), 32)
    got = vq_gemv(cuda_ready.to_device(x), plan, *dl, mats=(0, 2), shape=(rows, cols), x_div=2,
                  quantize=False).copy_to_host()
    assert_matches("gemv_bf16", got[0], _want(layer, 0, [x[0], x[0]], ids[0]))
    assert_matches("gemv_bf16", got[1], _want(layer, 2, [x[0], x[0]], ids[0]))
    a = round_bf16(rng.standard_normal((2, cols)))                  # w2: unquantised, the rule applied inside
    scale = rng.uniform(0.5, 1.5, (n_exp, rows)).astype(np.float32)
    got2 = vq_gemv(cuda_ready.to_device(a), plan, *dl, mats=(1,), shape=(rows, cols), scale=cuda_ready.to_device(scale),
                   quantize=True).copy_to_host()
    assert_matches("gemv_bf16", got2[0], _want(layer, 1, act_quant_fp8(a, 32), ids[0], scale))


@pytest.mark.parametrize("prefetch,rg", [(1, 1), (3, 1), (4, 1), (3, 2)])
def test_blocks_in_flight_give_the_same_bits(cuda_ready, monkeypatch, prefetch, rg):
    """The decode kernel with 1, 3 or 4 blocks of a row group loaded ahead (`prefetch`; the module's: PREFETCH), one
    or two row groups a unit: the module kernel's bits (6 blocks a row, so the loads past a row's end are clamped; 20
    rows: a full and a padded row group, two experts and an empty one)."""
    import kernels.vq_gemv as vq
    rng = np.random.default_rng(7)
    n_exp, rows, cols = 3, 20, 768
    layer = _layer(rng, n_exp, rows, cols, 13)
    dl = _device_layer(cuda_ready, layer)
    plan = vq.vq_plan(cuda_ready.to_device(np.array([[2, 0]], np.int32)), n_exp)
    x = cuda_ready.to_device(act_quant_fp8(round_bf16(rng.standard_normal((1, cols)) * 3), 32))
    base = vq.vq_gemv(x, plan, *dl, mats=(0, 2), shape=(rows, cols), x_div=2, quantize=False).copy_to_host()
    assert prefetch != vq.PREFETCH
    monkeypatch.setattr(vq, "vq_gemv_kernel", vq._make_vq_kernel(vq.THREADS, False, rg, prefetch))
    got = vq.vq_gemv(x, plan, *dl, mats=(0, 2), shape=(rows, cols), x_div=2, quantize=False).copy_to_host()
    np.testing.assert_array_equal(got, base)
    assert np.all(np.isfinite(base)) and np.any(base != 0)


def test_short_rows_12bit_batch_tiles_and_identity_gain(cuda_ready):
    """J = 12 (padded to 16 codewords), T = 3 tokens in tiles of two pairs; a token's rows equal its T = 1 result
    bit for bit; an all-ones sidecar equals none exactly."""
    from kernels.vq_gemv import vq_gemv, vq_plan
    rng = np.random.default_rng(1)
    n_exp, rows, cols, k_act = 4, 32, 96, 2
    layer = _layer(rng, n_exp, rows, cols, 12)
    dl = _device_layer(cuda_ready, layer)
    ids = np.array([[1, 3], [3, 1], [0, 3]], np.int32)            # expert 2 empty, expert 3 in every token
    x = round_bf16(rng.standard_normal((3, cols)) * 2)
    d_x = cuda_ready.to_device(x)
    plan = vq_plan(cuda_ready.to_device(ids), n_exp, tile_rows=2)
    got = vq_gemv(d_x, plan, *dl, mats=(0, 2), shape=(rows, cols), x_div=k_act).copy_to_host()
    xq = act_quant_fp8(x, 32)
    pairs_x = [xq[p // k_act] for p in range(6)]
    for j, m in enumerate((0, 2)):
        assert_matches("gemv_bf16", got[j], _want(layer, m, pairs_x, ids.reshape(-1)))
    one = vq_gemv(cuda_ready.to_device(x[2:]), vq_plan(cuda_ready.to_device(ids[2:]), n_exp), *dl, mats=(0, 2),
                  shape=(rows, cols), x_div=k_act).copy_to_host()
    np.testing.assert_array_equal(one, got[:, 4:6])
    a = cuda_ready.to_device(round_bf16(rng.standard_normal((6, cols))))
    none = vq_gemv(a, plan, *dl, mats=(1,), shape=(rows, cols)).copy_to_host()
    ones = vq_gemv(a, plan, *dl, mats=(1,), shape=(rows, cols),
                   scale=cuda_ready.to_device(np.ones((n_exp, rows), np.float32))).copy_to_host()
    np.testing.assert_array_equal(ones, none)


def test_staging_blocks_step_over_rows_past_the_grid(cuda_ready, monkeypatch):
    """The staging kernels put rows on the grid's y axis; past its limit (GRID_Y_MAX, 2 here) a block steps over rows
    by the grid's height. Five rows give the bits of the unlimited grid, through the plain and the SwiGLU staging."""
    import kernels
    import kernels.vq_gemv as vq
    rng = np.random.default_rng(9)
    n_exp, rows, cols = 2, 16, 96
    dl = _device_layer(cuda_ready, _layer(rng, n_exp, rows, cols, 12))
    ids = np.array([[1], [0], [1], [1], [0]], np.int32)
    plan = vq.vq_plan(cuda_ready.to_device(ids), n_exp, tile_rows=2)
    d_x = cuda_ready.to_device(round_bf16(rng.standard_normal((5, cols)) * 2))
    d_u = cuda_ready.to_device(round_bf16(rng.standard_normal((5, cols)) * 2))
    kw = dict(mats=(0, 1), shape=(rows, cols), quantize=True)
    want = [vq.vq_gemv(d_x, plan, *dl, **kw).copy_to_host(),
            vq.vq_gemv(d_x, plan, *dl, swiglu=(d_u, None, 2.0), **kw).copy_to_host()]
    monkeypatch.setattr(kernels, "GRID_Y_MAX", 2)           # read by kernels.rows_grid
    np.testing.assert_array_equal(vq.vq_gemv(d_x, plan, *dl, **kw).copy_to_host(), want[0])
    np.testing.assert_array_equal(vq.vq_gemv(d_x, plan, *dl, swiglu=(d_u, None, 2.0), **kw).copy_to_host(), want[1])


def test_staged_operand_skips_the_staging_with_the_same_bits(cuda_ready):
    """`staged=` (the B operand written by x's producer, here vq_stage itself) gives the bits of the call that stages
    x, for FP8-grid x (the MoE's w1 / w3) and for raw x staged with quantize=True; wrong shapes, a staged operand with
    SwiGLU, and a stale operand (it is used as given: x's values are not read) behave as documented."""
    from kernels.vq_gemv import stage_shapes, vq_gemv, vq_plan, vq_stage
    rng = np.random.default_rng(12)
    n_exp, rows, cols, k_act = 3, 16, 96, 2
    dl = _device_layer(cuda_ready, _layer(rng, n_exp, rows, cols, 13))
    ids = np.array([[2, 0], [1, 2]], np.int32)
    plan = vq_plan(cuda_ready.to_device(ids), n_exp)
    x = round_bf16(rng.standard_normal((2, cols)) * 2)
    kw = dict(mats=(0, 2), shape=(rows, cols), x_div=k_act)
    for quantize, xs in ((False, act_quant_fp8(x, 32)), (True, x)):
        d_x = cuda_ready.to_device(xs)
        staged = tuple(cuda_ready.device_array(sh, dt) for sh, dt in stage_shapes(2, cols))
        vq_stage(d_x, quantize=quantize, out=staged)
        want = vq_gemv(d_x, plan, *dl, quantize=quantize, **kw).copy_to_host()
        got = vq_gemv(d_x, plan, *dl, quantize=quantize, staged=staged, **kw).copy_to_host()
        np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32), err_msg=f"quantize={quantize}")
    zeros = cuda_ready.to_device(np.zeros((2, cols), np.float32))            # x unread: the staged operand counts
    np.testing.assert_array_equal(vq_gemv(zeros, plan, *dl, staged=staged, **kw).copy_to_host(), want)
    with pytest.raises(ValueError, match="staged"):
        vq_gemv(d_x, plan, *dl, staged=staged[::-1], **kw)
    with pytest.raises(ValueError, match="staged"):
        vq_gemv(d_x[:1], vq_plan(cuda_ready.to_device(ids[:1]), n_exp), *dl, staged=staged, **kw)
    with pytest.raises(ValueError, match="staged"):
        vq_gemv(d_x, plan, *dl, mats=(1,), shape=(rows, cols), staged=staged, swiglu=(d_x, None, 2.0))
    with pytest.raises(ValueError, match="vq_stage"):
        vq_stage(d_x, quantize=False, out=tuple(cuda_ready.device_array(sh, dt) for sh, dt in stage_shapes(1, cols)))


def test_tiles_of_sixteen_pairs_equal_one_pair_tiles(cuda_ready):
    """20 tokens routed to one expert: a tile of 16 pairs (MMA columns 8..15 live) and one of 4; every pair's rows equal
    those of one-pair tiles bit for bit, and the reference within the tolerance."""
    from kernels.vq_gemv import vq_gemv, vq_plan
    rng = np.random.default_rng(4)
    n_exp, rows, cols = 2, 16, 256
    layer = _layer(rng, n_exp, rows, cols, 13)
    dl = _device_layer(cuda_ready, layer)
    ids = np.ones((20, 1), np.int32)
    x = round_bf16(rng.standard_normal((20, cols)) * np.exp2(rng.integers(-6, 6, (20, 1))))
    d_x, d_ids = cuda_ready.to_device(x), cuda_ready.to_device(ids)
    wide = vq_gemv(d_x, vq_plan(d_ids, n_exp, tile_rows=16), *dl, mats=(1,), shape=(rows, cols)).copy_to_host()
    narrow = vq_gemv(d_x, vq_plan(d_ids, n_exp, tile_rows=1), *dl, mats=(1,), shape=(rows, cols)).copy_to_host()
    np.testing.assert_array_equal(wide, narrow)
    assert_matches("gemv_bf16", wide[0], _want(layer, 1, act_quant_fp8(x, 32), ids[:, 0]))


def test_13_12_13_bit_layers_in_turn(cuda_ready):
    """A 13-bit layer, a 12-bit layer, then the 13-bit one again through the same kernel (the engine's order):
    on the GPU the dynamic shared-memory limit raised for the 13-bit codebook must not be lowered in between. 24 rows:
    two row groups of 16, the second padded (its rows 24..31 computed and not stored)."""
    from kernels.vq_gemv import vq_gemv, vq_plan
    rng = np.random.default_rng(5)
    n_exp, rows, cols = 2, 24, 64
    ids = np.array([[1]], np.int32)
    x = round_bf16(rng.standard_normal((1, cols)))
    layers = {b: _layer(rng, n_exp, rows, cols, b) for b in (13, 12)}
    for bits in (13, 12, 13):
        plan = vq_plan(cuda_ready.to_device(ids), n_exp)
        got = vq_gemv(cuda_ready.to_device(x), plan, *_device_layer(cuda_ready, layers[bits]), mats=(0,),
                      shape=(rows, cols)).copy_to_host()
        assert_matches("gemv_bf16", got[0], _want(layers[bits], 0, [act_quant_fp8(x, 32)[0]], ids[0]))


def test_swiglu_folded_into_the_staging_equals_swiglu_then_gemv(cuda_ready):
    """vq_gemv(g, ..., swiglu=(u, weights, limit)) == vq_gemv(moe.swiglu(g, u, limit, weights), ...) bit for bit, g
    and u the two halves of one [2, n, F] gate/up output: with and without routing weights, a clamping limit and
    limit <= 0 (no clamp); J = 12 codewords padded to 16. swiglu= needs quantize=True."""
    from kernels.moe import swiglu
    from kernels.vq_gemv import vq_gemv, vq_plan
    rng = np.random.default_rng(7)
    n_exp, rows, cols = 2, 8, 96
    layer = _layer(rng, n_exp, rows, cols, 12)
    dl = _device_layer(cuda_ready, layer)
    ids = np.array([[1, 0], [0, 1]], np.int32)
    plan = vq_plan(cuda_ready.to_device(ids), n_exp, tile_rows=2)
    gu = round_bf16(rng.standard_normal((2, 4, cols)) * 4)            # |u| and g beyond the limit: some clamps
    d_gu = cuda_ready.to_device(gu)
    d_w = cuda_ready.to_device(rng.uniform(0.05, 1.0, 4).astype(np.float32))
    kw = dict(mats=(1,), shape=(rows, cols), quantize=True)
    for weights, limit in ((d_w, 2.5), (d_w, 0.0), (None, 2.5), (None, -1.0)):
        a = swiglu(d_gu[0], d_gu[1], limit, weights=weights)
        want = vq_gemv(a, plan, *dl, **kw).copy_to_host()
        got = vq_gemv(d_gu[0], plan, *dl, swiglu=(d_gu[1], weights, limit), **kw).copy_to_host()
        assert np.array_equal(got, want), (weights is None, limit)
    with pytest.raises(ValueError):
        vq_gemv(d_gu[0], plan, *dl, mats=(1,), shape=(rows, cols), quantize=False, swiglu=(d_gu[1], None, 1.0))


@pytest.mark.parametrize("d,k_act", [(64, 3), (66, 3), (3, 3), (66, 6), (10, 10)])
def test_moe_combine_ascending_expert_order(cuda_ready, d, k_act):
    """Each output adds its token's expert terms in ascending id, then the shared expert; widths that are not a
    multiple of the columns a thread takes (COMBINE_COLS) end in a partial group; V4.1's 6 experts and more than
    COMBINE_K_FAST (the one-at-a-time path) give the same order."""
    from kernels.vq_gemv import COMBINE_K_FAST, moe_combine
    rng = np.random.default_rng(2 + k_act)
    ids = np.stack([rng.choice(4 * k_act, k_act, replace=False) for _ in range(2)]).astype(np.int32)
    ye = round_bf16(rng.standard_normal((2 * k_act, d)) * np.exp2(rng.integers(-8, 8, (2 * k_act, d))))
    for t, c in np.ndindex(2, d):       # +2^30 and -2^30 at two experts: the terms added between them vanish
        a, b = rng.choice(k_act, 2, replace=False)
        ye[t * k_act + a, c], ye[t * k_act + b, c] = 2.0 ** 30, -2.0 ** 30
    ysh = round_bf16(rng.standard_normal((2, d)))
    got = moe_combine(cuda_ready.to_device(ye), cuda_ready.to_device(ids), cuda_ready.to_device(ysh)).copy_to_host()
    want = np.zeros((2, d), np.float32)
    for t in range(2):
        y = np.zeros(d, np.float32)
        for k in np.argsort(ids[t]):
            y += ye[t * k_act + k]
        want[t] = round_bf16(y + ysh[t])
    np.testing.assert_array_equal(got, want)
    assert k_act != 10 or k_act > COMBINE_K_FAST


def test_bad_arguments(cuda_ready):
    from kernels.vq_gemv import vq_device_layout, vq_gemv, vq_plan
    rng = np.random.default_rng(3)
    _, _, index, _, gains = _layer(rng, 2, 8, 64, 12)
    d_index, _ = vq_device_layout(cuda_ready.to_device(index), None, (8, 64), (8, 64))
    dl = (cuda_ready.to_device(np.zeros(4096, np.uint64)), d_index, None,
          tuple(cuda_ready.to_device(np.ascontiguousarray(gains[:, m]).view(np.uint16)) for m in range(3)))
    plan = vq_plan(cuda_ready.to_device(np.array([[0]], np.int32)), 2)
    x = cuda_ready.to_device(np.zeros((1, 64), np.float32))
    with pytest.raises(ValueError):
        vq_gemv(x, plan, *dl, mats=(0,), shape=(16, 512))             # stream too short for the shape
    with pytest.raises(ValueError):
        vq_gemv(x, plan, dl[0], dl[1], cuda_ready.to_device(np.zeros((2, 3, 32), np.uint8)), dl[3], mats=(0,),
                shape=(8, 64))                                        # a plane with a 4096-entry codebook
    with pytest.raises(ValueError):
        vq_gemv(x, plan, cuda_ready.to_device(np.zeros((4096, 8), np.uint8)), *dl[1:], mats=(0,), shape=(8, 64))
    with pytest.raises(ValueError):
        vq_device_layout(cuda_ready.to_device(index), None, (8, 64), (16, 64))   # w2 holds more weights
    with pytest.raises(ValueError):
        vq_plan(cuda_ready.to_device(np.zeros((1, 2), np.int64)), 2)
    with pytest.raises(ValueError):
        vq_plan(cuda_ready.to_device(np.zeros((1, 2), np.int32)), 2, tile_rows=17)


def test_sm90_ptx_has_no_local_memory_and_uses_the_tensor_cores():
    """Compiled for sm_90 without a GPU: the GEMV keeps its state in registers and multiplies on the tensor cores
    (f16, the codewords converted from E4M3); the staging and relayout kernels use no local memory either."""
    names = ("vq_gemv_kernel", "vq_gemv_wide_kernel", "vq_stage_kernel", "vq_stage_swiglu_kernel", "vq_relayout_kernel")
    r = ptx_counts([f"vq_gemv:{k}" for k in names], [".local", "mma.sync.aligned.m16n8k16", "cvt.rn.f16x2.e4m3x2"])
    for k in names:
        v = r[f"vq_gemv:{k}"]
        assert v["sm90"] and v[".local"] == 0, r
    v = r["vq_gemv:vq_gemv_kernel"]                 # a block's 4 steps: 2 MMAs and 8 conversions each
    assert v["mma.sync.aligned.m16n8k16"] >= 8 and v["cvt.rn.f16x2.e4m3x2"] >= 32, r
    assert r["vq_gemv:vq_gemv_wide_kernel"]["mma.sync.aligned.m16n8k16"] >= 16, r


def _plan_want(ids, n_experts, tile_rows):
    """The plan's definition (vq_plan): pair p = t*K + k; the pairs of each expert in ascending p, experts
    ascending, ids outside 0..E-1 left out; tiles of up to tile_rows consecutive pairs of one expert."""
    flat = ids.reshape(-1)
    pairs, tiles = [], []
    for e in range(n_experts):
        ps = np.flatnonzero(flat == e)
        tiles += [(e, len(pairs) + i, min(tile_rows, len(ps) - i)) for i in range(0, len(ps), tile_rows)]
        pairs += list(ps)
    return np.array(pairs, np.int32), np.array(tiles, np.int32).reshape(-1, 3)


def _routing(rng, n_tok, k_act, n_exp):
    return np.stack([rng.choice(n_exp, k_act, replace=False) for _ in range(n_tok)]).astype(np.int32)


@pytest.mark.parametrize("n_tok, k_act, n_exp, tile_rows", [
    (1, 6, 384, 1),            # V4.1 decode
    (1, 1, 1, 2),              # one pair, one expert
    (5, 3, 7, 2),              # E not a power of two
    (70, 6, 384, 2),           # several 32-pair steps per warp; expert 383 in every token, expert 0 in one
    (33, 16, 512, 1),          # K_MAX, E_MAX; pairs not a multiple of 32
    (40, 6, 48, 16),           # prefill tiles of up to 16 pairs (ds4-tiny's expert count)
])
def test_plan_matches_its_definition(cuda_ready, n_tok, k_act, n_exp, tile_rows):
    from kernels.vq_gemv import vq_plan
    rng = np.random.default_rng(n_tok * 1000 + n_exp)
    ids = _routing(rng, n_tok, k_act, n_exp)
    if n_tok > 2:
        ids[:, 0] = n_exp - 1
        ids[2, 1] = 0
    plan = vq_plan(cuda_ready.to_device(ids), n_exp, tile_rows=tile_rows)
    pairs, tiles = _plan_want(ids, n_exp, tile_rows)
    n = int(plan.n_tiles.copy_to_host()[0])
    np.testing.assert_array_equal(plan.pairs.copy_to_host()[:len(pairs)], pairs)
    assert n == len(tiles)
    np.testing.assert_array_equal(plan.tiles.copy_to_host()[:n], tiles)


def test_plan_reuse_repeated_and_out_of_range_ids(cuda_ready):
    """A reused plan is rewritten in full; a token naming an expert twice keeps both pairs in pair order; ids
    outside 0..E-1 are left out of the plan."""
    from kernels.vq_gemv import vq_plan
    rng = np.random.default_rng(4)
    plan = vq_plan(cuda_ready.to_device(_routing(rng, 4, 3, 5)), 5, tile_rows=2)
    ids = np.array([[3, 3, -1], [4, 2, 3], [9, 0, 3], [3, 1, 2]], np.int32)
    plan = vq_plan(cuda_ready.to_device(ids), 5, tile_rows=2, out=plan)
    pairs, tiles = _plan_want(ids, 5, 2)
    n = int(plan.n_tiles.copy_to_host()[0])
    np.testing.assert_array_equal(plan.pairs.copy_to_host()[:len(pairs)], pairs)
    assert n == len(tiles)
    np.testing.assert_array_equal(plan.tiles.copy_to_host()[:n], tiles)


def test_plan_does_not_depend_on_the_block_size(cuda_ready):
    """One warp (every pair in one warp's run, every expert in few threads' runs) writes the launcher's plan."""
    from kernels.vq_gemv import vq_plan, vq_plan_kernel
    rng = np.random.default_rng(6)
    ids = _routing(rng, 30, 6, 50)
    d_ids = cuda_ready.to_device(ids)
    plan = vq_plan(d_ids, 50, tile_rows=2)
    pairs = cuda_ready.device_array(180, np.int32)
    tiles = cuda_ready.device_array((180, 3), np.int32)
    n_tiles = cuda_ready.device_array(1, np.int32)
    vq_plan_kernel[1, 32](d_ids, 50, 2, pairs, tiles, n_tiles)
    n = int(n_tiles.copy_to_host()[0])
    assert n == int(plan.n_tiles.copy_to_host()[0])
    np.testing.assert_array_equal(pairs.copy_to_host(), plan.pairs.copy_to_host())
    np.testing.assert_array_equal(tiles.copy_to_host()[:n], plan.tiles.copy_to_host()[:n])


def test_sm90_ptx_plan_counts_in_shared_memory():
    """The plan kernel counts with shared-memory atomics and keeps no local (stack) arrays."""
    v = ptx_counts(["vq_gemv:vq_plan_kernel"], [".local", "atom.shared.add"])["vq_gemv:vq_plan_kernel"]
    assert v["sm90"] and v[".local"] == 0 and v["atom.shared.add"] >= 1, v
