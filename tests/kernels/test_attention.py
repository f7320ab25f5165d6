"""kernels/attention.py against ds4lib.ref.attention.sparse_attention and the reference's window rule."""
from types import SimpleNamespace

import numpy as np
import pytest
from numba import cuda                  # the simulator swaps this global inside kernels (conftest chose the mode)

from ds4lib.config import ModelConfig
from ds4lib.formats.actquant import act_quant_fp8
from ds4lib.formats.floats import f32_to_bf16_bits, round_bf16
from ds4lib.ref.attention import sparse_attention as ref_attention
from ds4lib.ref.model import ReferenceModel
from kernels.bf16 import exp_f32_device
from tests.kernels.filled import filled
from tests.kernels.tolerances import assert_matches

CFG = ModelConfig.tiny()
W, DH, H = CFG.window_size, CFG.head_dim, CFG.n_heads


def _rows(rng, n):
    return act_quant_fp8(round_bf16(rng.standard_normal((n, DH)) * 2), 32)       # cached rows are FP8-simulated


def _setup(cuda, rng, start, T):
    """A window state holding positions max(0, start-W)..start-1, a chunk of T new rows; both sides' views."""
    hist_pos = np.arange(max(0, start - W), start, dtype=np.int64)
    hist = _rows(rng, len(hist_pos))
    ring = np.zeros((W, DH), np.uint16)
    ring_pos = np.full(W, -1, np.int64)
    ring[hist_pos % W], ring_pos[hist_pos % W] = f32_to_bf16_bits(hist), hist_pos
    kv = _rows(rng, T)
    P = np.arange(start, start + T, dtype=np.int64)
    state = SimpleNamespace(win_kv=[hist], win_pos=[hist_pos])
    keys, mask = ReferenceModel._window(SimpleNamespace(cfg=CFG), 0, kv, P, state)     # the reference's rule
    return ring, ring_pos, kv, P, keys, mask


def _kernel_window(cuda, ring, ring_pos, kv, P, start):
    """Key buffer [ring; chunk] (chunk rows packed by cache_write) and the window index lists."""
    from kernels.attention import cache_write, window_indices
    buf = cuda.to_device(np.concatenate([ring, np.zeros((len(kv), DH), np.uint16)]))
    cache_write(cuda.to_device(kv), cuda.to_device(np.arange(W, W + len(kv), dtype=np.int64)), buf)
    idx = window_indices(cuda.to_device(ring_pos), cuda.to_device(P))
    return buf, idx


@pytest.mark.parametrize("start,T,heads,n_cmp,k,n_split", [
    (40, 1, H, 20, CFG.index_topk, None),   # decode: window from the ring + the new row, 8 compressed rows
    (14, 3, 4, 6, 4, 2),                    # chunked prefill: early queries read ring rows the chunk has not replaced
    (3000, 1, 4, 300, 200, 3),              # longest here: 216 rows (2 score blocks), 3 value splits, 2 tiles
])
def test_sparse_attention_matches_ref(cuda_ready, start, T, heads, n_cmp, k, n_split):
    from kernels.attention import sparse_attention
    rng = np.random.default_rng(start)
    ring, ring_pos, kv, P, keys, mask = _setup(cuda_ready, rng, start, T)
    buf, win_idx = _kernel_window(cuda_ready, ring, ring_pos, kv, P, start)
    cmp = _rows(rng, n_cmp)
    idx = np.stack([np.sort(rng.choice(n_cmp, k, replace=False)) for _ in range(T)]).astype(np.int32)
    idx[:, -2:] = -1                                                              # padded top-k slots
    q = round_bf16(rng.standard_normal((T, heads, DH)))
    sink = rng.standard_normal(heads).astype(np.float32)
    scale = DH ** -0.5
    got = sparse_attention(cuda_ready.to_device(q), buf, win_idx, cuda_ready.to_device(f32_to_bf16_bits(cmp)),
                           cuda_ready.to_device(idx), cuda_ready.to_device(sink), scale, n_split=n_split)
    want = ref_attention(q, keys, mask, cmp[np.maximum(idx, 0)], idx >= 0, sink, scale)
    assert_matches("sparse_attention", got.copy_to_host(), want)
    if n_split == 3:   # the launcher's two value layouts, one split (prefill) and one per 32-row chunk (decode)
        args = (cuda_ready.to_device(q), buf, win_idx, cuda_ready.to_device(f32_to_bf16_bits(cmp)),
                cuda_ready.to_device(idx), cuda_ready.to_device(sink), scale)
        one = sparse_attention(*args, n_split=1).copy_to_host()
        n_chunks = -(-(win_idx.shape[1] + k) // 32)                          # 216 rows: 7 chunks
        chunks = sparse_attention(*args, n_split=n_chunks).copy_to_host()
        np.testing.assert_array_equal(one.view(np.uint32), chunks.view(np.uint32))


@pytest.mark.parametrize("start,T", [(40, 1), (14, 3), (5, W + 2)])
def test_window_write_in_the_combine_equals_window_write(cuda_ready, start, T):
    """sparse_attention(..., window=(kv, positions, ring, ring_pos)) gives the attention's bits and leaves the ring
    (the key buffer's first W rows, which the attention read) and its positions exactly as sparse_attention then
    window_write leave them: decode, a chunk, and a chunk longer than the window (its last W rows)."""
    from kernels.attention import sparse_attention, window_write
    rng = np.random.default_rng(start + T)
    ring, ring_pos, kv, P, _, _ = _setup(cuda_ready, rng, start, T)
    q = cuda_ready.to_device(round_bf16(rng.standard_normal((T, 4, DH))))
    sink = cuda_ready.to_device(rng.standard_normal(4).astype(np.float32))
    kv_d, p_d = cuda_ready.to_device(kv), cuda_ready.to_device(P)
    outs, bufs, rps = [], [], []
    for fused in (False, True):
        buf, win_idx = _kernel_window(cuda_ready, ring, ring_pos, kv, P, start)
        rp = cuda_ready.to_device(ring_pos)
        window = (kv_d, p_d, buf[:W], rp)
        o = sparse_attention(q, buf, win_idx, None, None, sink, DH ** -0.5, window=window if fused else None)
        if not fused:
            window_write(*window)
        outs.append(o.copy_to_host())
        bufs.append(buf.copy_to_host())
        rps.append(rp.copy_to_host())
    np.testing.assert_array_equal(outs[1].view(np.uint32), outs[0].view(np.uint32))
    np.testing.assert_array_equal(bufs[1][:W], bufs[0][:W])
    np.testing.assert_array_equal(rps[1], rps[0])
    assert not np.array_equal(rps[1], ring_pos)                                  # the ring did move
    with pytest.raises(ValueError, match="window"):
        sparse_attention(q, buf, win_idx, None, None, sink, DH ** -0.5, window=(kv_d, p_d, buf[:W], rp[:2]))


@pytest.mark.parametrize("start,T", [(40, 1), (14, 3)])
def test_output_staged_in_the_combine_equals_im_stage(cuda_ready, start, T):
    """sparse_attention(..., im_stage=(digits, pairs)): the attention's bits (with the window write and the inverse
    RoPE fused too, as the engine runs it), and the output staged for the output projection's integer path exactly
    as kernels.q4k_gemv.im_stage of out [T, H * Dh] stages it (the launch it saves); operands of the wrong shape and a
    strided out are refused."""
    from kernels.attention import sparse_attention
    from kernels.im_operand import im_stage_shapes
    from kernels.q4k_gemv import im_stage
    rng = np.random.default_rng(50 + T)
    ring, ring_pos, kv, P, _, _ = _setup(cuda_ready, rng, start, T)
    q = cuda_ready.to_device(round_bf16(rng.standard_normal((T, 4, DH))))
    sink = cuda_ready.to_device(rng.standard_normal(4).astype(np.float32))
    freqs = (1.0 / CFG.rope_theta ** (np.arange(0, CFG.rope_head_dim, 2) / CFG.rope_head_dim)).astype(np.float32)
    ang = np.outer(np.arange(64, dtype=np.float32), freqs).astype(np.float32)
    cos, sin = (cuda_ready.to_device(f(ang).astype(np.float32)) for f in (np.cos, np.sin))
    p_d = cuda_ready.to_device(P)
    rope = (p_d, cos, sin)

    def staged(fill):
        return filled(cuda_ready, im_stage_shapes(T, 4 * DH), fill)
    outs = []
    for fused in (False, True):
        buf, win_idx = _kernel_window(cuda_ready, ring, ring_pos, kv, P, start)
        window = (cuda_ready.to_device(kv), p_d, buf[:W], cuda_ready.to_device(ring_pos))
        got = staged(0xFFFFFFFF) if fused else None
        o = sparse_attention(q, buf, win_idx, None, None, sink, DH ** -0.5, inverse_rope=rope, rope_q=rope,
                             window=window, im_stage=got)
        outs.append(o.copy_to_host())
    np.testing.assert_array_equal(outs[1].view(np.uint32), outs[0].view(np.uint32))
    want = im_stage(cuda_ready.to_device(outs[0].reshape(T, 4 * DH)), quantize=False, out=staged(0x7F7F7F7F))
    for name, g, w in zip(("digits", "pairs"), got, want):
        np.testing.assert_array_equal(g.copy_to_host().view(np.uint32), w.copy_to_host().view(np.uint32),
                                      err_msg=name)
    assert np.count_nonzero(outs[0]) > outs[0].size // 2
    with pytest.raises(ValueError, match="staged"):
        sparse_attention(q, buf, win_idx, None, None, sink, DH ** -0.5, im_stage=got[::-1])
    strided = cuda_ready.device_array((T, 8, DH), np.float32)[:, ::2]
    with pytest.raises(ValueError, match="im_stage"):
        sparse_attention(q, buf, win_idx, None, None, sink, DH ** -0.5, out=strided, im_stage=got)


@cuda.jit
def _exp_kernel(x, out):
    """out[i] = exp_f32_device(x[i]): the device's own FP32 exp (libdevice's on the GPU, NumPy's in the simulator),
    so that an emulation of a kernel's sums uses the kernel's terms bit for bit on both targets."""
    i = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    if i < x.shape[0]:
        out[i] = exp_f32_device(x[i])


def _device_exp(cuda_mod, x):
    x = np.ascontiguousarray(x, np.float32).reshape(-1)
    out = cuda_mod.device_array(x.shape, np.float32)
    _exp_kernel[max(1, -(-x.size // 128)), 128](cuda_mod.to_device(x), out)
    return out.copy_to_host()


def _denominator_emulated(cuda_mod, z, sink):
    """The softmax's denominator per (t, h) as the value kernel forms it: f32(float64 sum of exp(z - max),
    lane-strided over 32 lanes, then the warp's shuffle-down tree) + exp(sink - max), with max NEG_BIG when no row
    is valid, and 0 then; the sums in NumPy, the exp terms the device's own (_device_exp: libdevice's expf is not
    NumPy's exp to the last bit)."""
    n_tok, n_heads, n_rows = z.shape
    m = z.max(axis=2)
    has = m > -np.inf
    m = np.where(has, m, np.float32(-1e30)).astype(np.float32)
    e_all = _device_exp(cuda_mod, (z - m[:, :, None]).astype(np.float32)).reshape(z.shape).astype(np.float64)
    e_sink = _device_exp(cuda_mod, (sink[None, :] - m).astype(np.float32)).reshape(m.shape)
    den = np.zeros((n_tok, n_heads), np.float32)
    for t in range(n_tok):
        for h in range(n_heads):
            e = e_all[t, h]
            v = np.array([sum(e[lane::32].tolist(), 0.0) for lane in range(32)])
            for off in (16, 8, 4, 2, 1):
                v[:32 - off] = v[:32 - off] + v[off:]
            if has[t, h]:
                den[t, h] = np.float32(np.float32(v[0]) + e_sink[t, h])
    return den


@pytest.mark.parametrize("n", [40, 700])
def test_value_kernel_softmax_denominator_and_scores(cuda_ready, n):
    """The softmax inside the value kernel: den is the softmax's float64 lane-and-tree sum plus the sink's term (0 for
    a query with no valid row), written once whatever the split count, and the scores in z are left as they were.
    700 rows are more than a lane's one batch of score loads (SOFTMAX_LOADS a lane: 640), which the denominator then
    reads again instead of reusing."""
    from kernels.attention import SOFTMAX_LOADS, WARP, sparse_attention
    assert (n > WARP * SOFTMAX_LOADS) == (n == 700)
    rng = np.random.default_rng(31)
    keys = _rows(rng, n)
    q = round_bf16(rng.standard_normal((3, 4, DH)))
    idx = np.stack([rng.permutation(n) for _ in range(3)]).astype(np.int32)
    idx[1, 5:] = -1
    idx[2, :] = -1                                                               # no valid row
    sink = rng.standard_normal(4).astype(np.float32)
    args = (cuda_ready.to_device(q), cuda_ready.to_device(f32_to_bf16_bits(keys)), cuda_ready.to_device(idx), None,
            None, cuda_ready.to_device(sink), DH ** -0.5)
    outs = []
    for n_split in (1, 2):
        scratch = {}
        outs.append(sparse_attention(*args, n_split=n_split, scratch=scratch).copy_to_host())
        z = scratch[("z", (3, 4, n), "<f4")].copy_to_host()
        den = scratch[("den", (3, 4), "<f4")].copy_to_host()
        assert np.isneginf(z[1, :, 5:]).all() and np.isfinite(z[0]).all()     # raw scores, not weights
        want = _denominator_emulated(cuda_ready, z, sink)
        np.testing.assert_array_equal(den.view(np.uint32), want.view(np.uint32))
        assert (den[2] == 0).all() and (den[:2] > 0).all()
    np.testing.assert_array_equal(outs[0].view(np.uint32), outs[1].view(np.uint32))
    assert (outs[0][2] == 0).all()


def test_value_splits_whose_first_group_straddles_the_window_end(cuda_ready):
    """Value splits across the window's end: with 36 window slots and 32-row splits, split 1's first group of rows
    holds window rows 32..35 and compressed rows 36..39, and the last split holds 3 rows (a group past its end);
    invalid slots on both sides. Each split count gives the reference's output, and both give the same bits."""
    from kernels.attention import sparse_attention
    rng = np.random.default_rng(36)
    n_win, kw, n_cmp, kc = 40, 36, 50, 31            # 67 rows: splits of 32, 32 and 3
    win, cmp = _rows(rng, n_win), _rows(rng, n_cmp)
    win_idx = np.stack([rng.permutation(n_win)[:kw] for _ in range(2)]).astype(np.int32)
    cmp_idx = np.stack([rng.permutation(n_cmp)[:kc] for _ in range(2)]).astype(np.int32)
    win_idx[0, 33], cmp_idx[1, 1], cmp_idx[0, -1] = -1, -1, -1
    q = round_bf16(rng.standard_normal((2, 4, DH)))
    sink = rng.standard_normal(4).astype(np.float32)
    scale = DH ** -0.5
    mask = np.zeros((2, n_win), bool)
    for t in range(2):
        mask[t, win_idx[t][win_idx[t] >= 0]] = True
    want = ref_attention(q, win, mask, cmp[np.maximum(cmp_idx, 0)], cmp_idx >= 0, sink, scale)
    outs = []
    for n_split in (1, 3):
        got = sparse_attention(cuda_ready.to_device(q), cuda_ready.to_device(f32_to_bf16_bits(win)),
                               cuda_ready.to_device(win_idx), cuda_ready.to_device(f32_to_bf16_bits(cmp)),
                               cuda_ready.to_device(cmp_idx), cuda_ready.to_device(sink), scale, n_split=n_split)
        outs.append(got.copy_to_host())
        assert_matches("sparse_attention", outs[-1], want)
    np.testing.assert_array_equal(outs[0].view(np.uint32), outs[1].view(np.uint32))


def test_sparse_attention_at_the_v41_head_dim(cuda_ready):
    """Head dim 512, V4.1's: a score lane loads 32 words of a row, in four groups of 8, before its products, and
    the value kernel 32 rows' words; every word and row counts (against the reference, and a score against its
    float64 dot product), a padded window slot and padded top-k slots not at all."""
    from kernels.attention import sparse_attention
    dh, heads, n_win, n_cmp, k = 512, 4, 12, 70, 44
    rng = np.random.default_rng(512)
    win = act_quant_fp8(round_bf16(rng.standard_normal((n_win, dh)) * 2), 32)
    cmp = act_quant_fp8(round_bf16(rng.standard_normal((n_cmp, dh)) * 2), 32)
    win_idx = np.array([list(range(n_win - 1)) + [-1]], np.int32)
    idx = np.sort(rng.choice(n_cmp, k, replace=False))[None].astype(np.int32)
    idx[:, -3:] = -1
    q = round_bf16(rng.standard_normal((1, heads, dh)))
    sink = rng.standard_normal(heads).astype(np.float32)
    scale = dh ** -0.5
    scratch = {}
    got = sparse_attention(cuda_ready.to_device(q), cuda_ready.to_device(f32_to_bf16_bits(win)),
                           cuda_ready.to_device(win_idx), cuda_ready.to_device(f32_to_bf16_bits(cmp)),
                           cuda_ready.to_device(idx), cuda_ready.to_device(sink), scale, scratch=scratch)
    seen = np.zeros((1, n_win), bool)
    seen[0, win_idx[0][win_idx[0] >= 0]] = True
    want = ref_attention(q, win, seen, cmp[np.maximum(idx, 0)], idx >= 0, sink, scale)
    assert_matches("sparse_attention", got.copy_to_host(), want)
    z = scratch[("z", (1, heads, n_win + k), "<f4")].copy_to_host()
    rows = np.concatenate([win[np.maximum(win_idx[0], 0)], cmp[np.maximum(idx[0], 0)]])
    exact = (q[0].astype(np.float64) @ rows.T.astype(np.float64)) * scale
    live = np.concatenate([win_idx[0], idx[0]]) >= 0
    np.testing.assert_allclose(z[0][:, live], exact[:, live], rtol=0, atol=2e-5 * np.abs(exact).max())
    assert np.isneginf(z[0][:, ~live]).all()


def test_rope_q_at_the_v41_head_dim_equals_the_rope_kernel(cuda_ready):
    """Head dim 512 with V4.1's 64 rotating dims: a staging thread holds 4 elements of each head's query, only the
    last of which rotates, with its pair's other value from the neighbouring lane; sparse_attention(..., rope_q=)
    gives exactly rope.rope(q) then sparse_attention, at two positions."""
    from kernels.attention import sparse_attention
    from kernels.rope import rope
    dh, heads, n = 512, 4, 20
    rng = np.random.default_rng(64)
    keys = act_quant_fp8(round_bf16(rng.standard_normal((n, dh)) * 2), 32)
    q = round_bf16(rng.standard_normal((2, heads, dh)))
    idx = np.stack([rng.permutation(n) for _ in range(2)]).astype(np.int32)
    pos = np.array([5, 17], np.int64)
    freqs = (1.0 / 10000.0 ** (np.arange(0, 64, 2) / 64)).astype(np.float32)
    ang = np.outer(np.arange(32, dtype=np.float32), freqs).astype(np.float32)
    cos, sin = cuda_ready.to_device(np.cos(ang)), cuda_ready.to_device(np.sin(ang))
    p_dev = cuda_ready.to_device(pos)
    rest = (cuda_ready.to_device(f32_to_bf16_bits(keys)), cuda_ready.to_device(idx), None, None,
            cuda_ready.to_device(rng.standard_normal(heads).astype(np.float32)), dh ** -0.5)
    q_rot = rope(cuda_ready.to_device(q), p_dev, cos, sin)
    assert not np.array_equal(q_rot.copy_to_host(), q)
    want = sparse_attention(q_rot, *rest).copy_to_host()
    got = sparse_attention(cuda_ready.to_device(q), *rest, rope_q=(p_dev, cos, sin)).copy_to_host()
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


def test_score_rows_per_quad_does_not_change_a_bit(cuda_ready):
    """The launcher gives a decode step 1 or 2 rows per quad (more score blocks) and big prefills 4: the same bits."""
    from kernels.attention import sparse_attention
    rng = np.random.default_rng(5)
    ring, ring_pos, kv, P, _, _ = _setup(cuda_ready, rng, 14, 3)
    buf, win_idx = _kernel_window(cuda_ready, ring, ring_pos, kv, P, 14)
    cmp = _rows(rng, 9)
    idx = np.stack([np.sort(rng.choice(9, 5, replace=False)) for _ in range(3)]).astype(np.int32)
    idx[1, -1] = -1
    args = (cuda_ready.to_device(round_bf16(rng.standard_normal((3, 4, DH)))), buf, win_idx,
            cuda_ready.to_device(f32_to_bf16_bits(cmp)), cuda_ready.to_device(idx),
            cuda_ready.to_device(rng.standard_normal(4).astype(np.float32)), DH ** -0.5)
    got = [sparse_attention(*args, rows_per_quad=r).copy_to_host() for r in (4, 2, 1)]
    np.testing.assert_array_equal(got[0], got[1])
    np.testing.assert_array_equal(got[0], got[2])


def test_inverse_rope_in_the_combine_equals_the_rope_kernel(cuda_ready):
    """sparse_attention(..., inverse_rope=(positions, cos, sin)) leaves exactly what sparse_attention then
    rope.rope(inverse=True) leave (the engine's decode path), for a chunk of 3 queries at odd positions, a query
    with no valid row and one with a single row; the arguments are checked."""
    from kernels.attention import sparse_attention
    from kernels.rope import rope
    rng = np.random.default_rng(7)
    keys = _rows(rng, 6)
    q = round_bf16(rng.standard_normal((3, 4, DH)))
    idx = np.array([[0, 3, 5, 2], [-1, -1, -1, -1], [4, -1, -1, -1]], np.int32)
    pos = np.array([11, 12, 13], np.int64)
    freqs = (1.0 / CFG.rope_theta ** (np.arange(0, CFG.rope_head_dim, 2) / CFG.rope_head_dim)).astype(np.float32)
    ang = np.outer(np.arange(32, dtype=np.float32), freqs).astype(np.float32)
    cos, sin = (cuda_ready.to_device(np.cos(ang).astype(np.float32)), cuda_ready.to_device(np.sin(ang).astype(np.float32)))
    args = (cuda_ready.to_device(q), cuda_ready.to_device(f32_to_bf16_bits(keys)), cuda_ready.to_device(idx), None,
            None, cuda_ready.to_device(rng.standard_normal(4).astype(np.float32)), DH ** -0.5)
    p_dev = cuda_ready.to_device(pos)
    want = rope(sparse_attention(*args), p_dev, cos, sin, inverse=True).copy_to_host()
    got = sparse_attention(*args, inverse_rope=(p_dev, cos, sin)).copy_to_host()
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
    assert not np.array_equal(got, sparse_attention(*args).copy_to_host())        # the tail did rotate
    with pytest.raises(ValueError, match="inverse_rope"):
        sparse_attention(*args, inverse_rope=(cuda_ready.to_device(pos[:2]), cos, sin))


def test_rope_q_in_the_scores_equals_the_rope_kernel(cuda_ready):
    """sparse_attention(..., rope_q=(positions, cos, sin)) on the unrotated queries gives exactly what rope.rope(q)
    then sparse_attention give (the engine's decode path before the rotation moved into the score kernel), with and
    without the output's inverse rotation, and leaves q unrotated; mismatched positions are refused."""
    from kernels.attention import sparse_attention
    from kernels.rope import rope
    rng = np.random.default_rng(8)
    keys = _rows(rng, 6)
    q = round_bf16(rng.standard_normal((3, 4, DH)))
    idx = np.array([[0, 3, 5, 2], [1, 4, -1, -1], [4, -1, -1, -1]], np.int32)
    pos = np.array([11, 29, 3], np.int64)
    freqs = (1.0 / CFG.rope_theta ** (np.arange(0, CFG.rope_head_dim, 2) / CFG.rope_head_dim)).astype(np.float32)
    ang = np.outer(np.arange(32, dtype=np.float32), freqs).astype(np.float32)
    cos, sin = (cuda_ready.to_device(np.cos(ang).astype(np.float32)), cuda_ready.to_device(np.sin(ang).astype(np.float32)))
    p_dev = cuda_ready.to_device(pos)
    tables = (p_dev, cos, sin)
    rest = (cuda_ready.to_device(f32_to_bf16_bits(keys)), cuda_ready.to_device(idx), None, None,
            cuda_ready.to_device(rng.standard_normal(4).astype(np.float32)), DH ** -0.5)
    q_dev = cuda_ready.to_device(q)
    q_rot = rope(cuda_ready.to_device(q), p_dev, cos, sin)
    for inv in (None, tables):
        want = sparse_attention(q_rot, *rest, inverse_rope=inv).copy_to_host()
        got = sparse_attention(q_dev, *rest, inverse_rope=inv, rope_q=tables).copy_to_host()
        np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
    np.testing.assert_array_equal(q_dev.copy_to_host(), q)
    assert not np.array_equal(sparse_attention(q_dev, *rest).copy_to_host(),
                              sparse_attention(q_rot, *rest).copy_to_host())   # the rotation matters
    with pytest.raises(ValueError, match="rope_q"):
        sparse_attention(q_dev, *rest, rope_q=(cuda_ready.to_device(pos[:2]), cos, sin))


def test_no_valid_rows_give_zero_and_window_only(cuda_ready):
    from kernels.attention import sparse_attention
    rng = np.random.default_rng(5)
    keys = _rows(rng, 6)
    q = round_bf16(rng.standard_normal((2, 4, DH)))
    idx = np.array([[0, 3, 5, -1], [-1, -1, -1, -1]], np.int32)                   # query 1 sees nothing
    sink = np.zeros(4, np.float32)
    got = sparse_attention(cuda_ready.to_device(q), cuda_ready.to_device(f32_to_bf16_bits(keys)),
                           cuda_ready.to_device(idx), None, None, cuda_ready.to_device(sink), 0.125).copy_to_host()
    mask = np.zeros((2, 6), bool)
    mask[0, [0, 3, 5]] = True
    with np.errstate(over="ignore"):                                             # exp(sink + 1e30) in the ref
        want = ref_attention(q, keys, mask, None, None, sink, 0.125)
    assert_matches("sparse_attention", got, want)
    assert not got[1].any()


def test_window_write_ring(cuda_ready):
    """Prefill longer than the window keeps the last W rows; a decode step replaces the oldest slot."""
    from kernels.attention import window_write
    from ds4lib.formats.floats import bf16_bits_to_f32
    rng = np.random.default_rng(9)
    ring = cuda_ready.to_device(np.zeros((W, DH), np.uint16))
    ring_pos = cuda_ready.to_device(np.full(W, -1, np.int64))
    kv = _rows(rng, W + 5)
    window_write(cuda_ready.to_device(kv), cuda_ready.to_device(np.arange(W + 5, dtype=np.int64)), ring, ring_pos)
    pos = ring_pos.copy_to_host()
    np.testing.assert_array_equal(np.sort(pos), np.arange(5, W + 5))            # the prefill's last W rows
    assert_matches("window", bf16_bits_to_f32(ring.copy_to_host()), kv[pos])
    nxt = _rows(rng, 1)
    window_write(cuda_ready.to_device(nxt), cuda_ready.to_device(np.array([W + 5], np.int64)), ring, ring_pos)
    pos = ring_pos.copy_to_host()
    np.testing.assert_array_equal(np.sort(pos), np.arange(6, W + 6))
    rows = bf16_bits_to_f32(ring.copy_to_host())
    allkv = np.concatenate([kv, nxt])
    assert_matches("window", rows, allkv[pos])


@pytest.mark.parametrize("n_split", [20, 13, 6, 30])   # V4.1's decode at 64k (640 rows: 20 chunks), ragged counts
def test_combine_adds_the_splits_in_order(cuda_ready, n_split):
    """The combine adds a head's split sums s = 0, 1, ... one by one, whatever loads it keeps in flight (30 splits:
    more than one batch of COMBINE_LOADS): bit for bit against that sequence in float32, then / den and BF16 rounding
    (no RoPE here; den == 0 gives 0)."""
    from kernels.attention import THREADS, attn_combine_kernel
    rng = np.random.default_rng(n_split)
    heads = 4
    part = rng.standard_normal((1, n_split, heads, DH)).astype(np.float32)
    for e in np.ndindex(heads, DH):     # +2^30 and -2^30 at two splits: the small terms added between them vanish
        a, b = rng.choice(n_split, 2, replace=False)
        part[0, a][e], part[0, b][e] = 2.0 ** 30, -2.0 ** 30
    den = rng.uniform(0.5, 4.0, (1, heads)).astype(np.float32)
    den[0, 1] = 0.0
    out = cuda_ready.device_array((1, heads, DH), np.float32)
    none = cuda_ready.to_device(np.zeros((1, 1), np.float32))
    no_pos = cuda_ready.to_device(np.zeros(1, np.int64))
    attn_combine_kernel[-(-heads * DH // THREADS), THREADS](cuda_ready.to_device(part), cuda_ready.to_device(den),
                                                          no_pos, none, none, False, none, no_pos,
                                                          cuda_ready.to_device(np.zeros((1, 1), np.uint16)), no_pos,
                                                          False, cuda_ready.to_device(np.zeros(1, np.uint32)),
                                                          none.reshape(1), False, out)
    num = part[:, 0].copy()
    for s in range(1, n_split):
        num = num + part[:, s]                                       # float32 adds, one split at a time
    want = np.where(den[:, :, None] > 0, round_bf16(num / np.where(den > 0, den, 1)[:, :, None]), 0).astype(np.float32)
    np.testing.assert_array_equal(out.copy_to_host().view(np.uint32), want.view(np.uint32))
