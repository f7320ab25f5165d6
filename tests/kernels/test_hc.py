"""kernels/hc.py against ds4lib.ref.hc (mixes within tolerance; collapse and expand bit-exact)."""
import numpy as np
import pytest
from numba import cuda

from ds4lib.config import ModelConfig
from ds4lib.formats.floats import round_bf16
from ds4lib.ref.hc import hc_mixes as ref_mixes
from ds4lib.ref.hc import hc_post as ref_post
from ds4lib.ref.hc import hc_pre as ref_pre
from tests.kernels.tolerances import assert_matches

CFG = ModelConfig.tiny()
KW = dict(norm_eps=CFG.norm_eps, hc_eps=CFG.hc_eps, iters=CFG.hc_sinkhorn_iters)


def _case(rng, T, D):
    h = round_bf16(rng.standard_normal((T, 4, D)) * rng.uniform(0.5, 3, (T, 4, 1)))
    fn = (rng.standard_normal((24, 4 * D)) * 0.05).astype(np.float32)
    base = (rng.standard_normal(24) * 0.5).astype(np.float32)
    scale = np.array([0.7, 1.3, 2.0], dtype=np.float32)
    return h, fn, base, scale


@pytest.mark.parametrize("T,D", [(1, CFG.dim),      # decode
                                 (2, 200),          # ragged: 800 columns over blocks of 128
                                 (1, 1200),         # 38 partial blocks: the finishing sum's 4-load loop
                                 (5, 96)])          # T > FUSED_T_MAX: the two-kernel path
def test_hc_mixes_collapse_expand(cuda_ready, T, D):
    from kernels.hc import hc_mixes, hc_post, hc_pre
    rng = np.random.default_rng(T * 1000 + D)
    h, fn, base, scale = _case(rng, T, D)
    want_pre, want_post, want_comb = ref_mixes(h, fn, base, scale, **KW)
    d_h = cuda_ready.to_device(h)
    pre, post, comb = (a.copy_to_host() for a in hc_mixes(d_h, cuda_ready.to_device(fn), cuda_ready.to_device(base),
                                                         cuda_ready.to_device(scale), **KW))
    assert_matches("hc_mixes", pre, want_pre, bf16=False)
    assert_matches("hc_mixes", post, want_post, bf16=False)
    assert_matches("hc_mixes", comb, want_comb, bf16=False)
    np.testing.assert_allclose(comb.sum(axis=-2), 1.0, atol=1e-4)           # ends column-normalised
    # collapse and expand, bit-exact given the same mixes
    d_pre = cuda_ready.to_device(want_pre)
    assert_matches("hc_pre", hc_pre(d_h, d_pre).copy_to_host(), ref_pre(h, want_pre))
    y = round_bf16(rng.standard_normal((T, D)))
    want = ref_post(y, h, want_post, want_comb)
    got = hc_post(cuda_ready.to_device(y), d_h, cuda_ready.to_device(want_post), cuda_ready.to_device(want_comb),
                  out=d_h).copy_to_host()                                  # in place over the state
    assert_matches("hc_post", got, want)


def test_hc_pre_post_blocks_step_over_tokens_past_the_grid(cuda_ready, monkeypatch):
    """hc_pre and hc_post put tokens on the grid's y axis; past its limit (GRID_Y_MAX, 2 here) a block steps over
    tokens by the grid's height: every token still gets the reference's bits."""
    import kernels
    import kernels.hc as hc
    monkeypatch.setattr(kernels, "GRID_Y_MAX", 2)           # read by kernels.rows_grid
    rng = np.random.default_rng(11)
    T, D = 5, 160
    h = round_bf16(rng.standard_normal((T, 4, D)))
    pre = rng.uniform(0.1, 1.0, (T, 4)).astype(np.float32)
    post = rng.uniform(0.1, 2.0, (T, 4)).astype(np.float32)
    comb = rng.uniform(0.0, 1.0, (T, 4, 4)).astype(np.float32)
    y = round_bf16(rng.standard_normal((T, D)))
    d_h = cuda_ready.to_device(h)
    np.testing.assert_array_equal(hc.hc_pre(d_h, cuda_ready.to_device(pre)).copy_to_host(), ref_pre(h, pre))
    got = hc.hc_post(cuda_ready.to_device(y), d_h, cuda_ready.to_device(post), cuda_ready.to_device(comb))
    np.testing.assert_array_equal(got.copy_to_host(), ref_post(y, h, post, comb))


@pytest.mark.parametrize("T,D,k_act", [(1, 5120, 6), (3, 66, 6), (2, 40, 10)])
def test_hc_post_of_the_moe_terms_equals_combine_then_post(cuda_ready, T, D, k_act):
    """hc_post(None, h, ..., moe=(ye, ids, shared)) gives the bits of moe_combine then hc_post, in place on h as the
    engine calls it: V4.1's width and 6 experts, a width ending in a partial group of the combine's four columns,
    and more experts than the combine keeps in registers (its one-at-a-time path). The expert terms carry +-2^30 at
    two experts, so a wrong order of the adds shows; mismatched terms and y with moe are refused."""
    import kernels.hc as hc
    from kernels.vq_gemv import moe_combine
    rng = np.random.default_rng(T * D + k_act)
    ids = np.stack([rng.choice(4 * k_act, k_act, replace=False) for _ in range(T)]).astype(np.int32)
    ye = round_bf16(rng.standard_normal((T * k_act, D)) * np.exp2(rng.integers(-8, 8, (T * k_act, D))))
    for t, c in np.ndindex(T, D):
        a, b = rng.choice(k_act, 2, replace=False)
        ye[t * k_act + a, c], ye[t * k_act + b, c] = 2.0 ** 30, -2.0 ** 30
    ysh = round_bf16(rng.standard_normal((T, D)))
    h = round_bf16(rng.standard_normal((T, 4, D)))
    post = rng.uniform(0.1, 2.0, (T, 4)).astype(np.float32)
    comb = rng.uniform(0.0, 1.0, (T, 4, 4)).astype(np.float32)
    terms = tuple(cuda_ready.to_device(a) for a in (ye, ids, ysh))
    d_post, d_comb = cuda_ready.to_device(post), cuda_ready.to_device(comb)
    y = moe_combine(*terms)
    want = hc.hc_post(y, cuda_ready.to_device(h), d_post, d_comb).copy_to_host()
    d_h = cuda_ready.to_device(h)
    hc.hc_post(None, d_h, d_post, d_comb, out=d_h, moe=terms)
    np.testing.assert_array_equal(d_h.copy_to_host(), want)
    np.testing.assert_array_equal(want, ref_post(y.copy_to_host(), h, post, comb))
    with pytest.raises(ValueError, match="not both"):
        hc.hc_post(y, d_h, d_post, d_comb, moe=terms)
    with pytest.raises(ValueError, match="do not fit"):
        narrow = cuda_ready.to_device(np.ascontiguousarray(ysh[:, :-1]))
        hc.hc_post(None, d_h, d_post, d_comb, moe=(terms[0], terms[1], narrow))


def _two_kernels(cuda, h, fn, base, scale):
    """hc_mixes' two-kernel path (partial, then finish), launched directly whatever T."""
    from kernels.hc import (COLS_PER_BLOCK, FIN_THREADS, HC, N_ACC, THREADS, hc_mix_finish_kernel,
                            hc_mix_partial_kernel)
    T, _, D = h.shape
    n_blk = -(-HC * D // COLS_PER_BLOCK)
    partial = cuda.device_array((T, n_blk, N_ACC), np.float64)
    out = (cuda.device_array((T, HC), np.float32), cuda.device_array((T, HC), np.float32),
           cuda.device_array((T, HC, HC), np.float32))
    hc_mix_partial_kernel[n_blk, THREADS](cuda.to_device(h.reshape(T, HC * D)), cuda.to_device(fn), COLS_PER_BLOCK,
                                          partial)
    hc_mix_finish_kernel[T, FIN_THREADS](partial, cuda.to_device(base), cuda.to_device(scale), HC * D,
                                         np.float32(KW["norm_eps"]), np.float32(KW["hc_eps"]), KW["iters"], *out)
    return tuple(a.copy_to_host() for a in out)


@pytest.mark.parametrize("D", [96, 200])             # 384 columns: 3 partial blocks; 800: 7, the last ragged
def test_hc_mixes_fused_equals_two_kernels(cuda_ready, D):
    """T <= FUSED_T_MAX takes the one-launch kernel: the same bits as the two kernels for T = 1, 2, 3 (several
    blocks, so the last-ticket block sums the others' partials); its counter is zero again after each call, and
    a second call over the same scratch gives the same bits."""
    from kernels.hc import FUSED_T_MAX, hc_mixes
    assert FUSED_T_MAX >= 3
    for T in (1, 2, 3):
        rng = np.random.default_rng(T * 100 + D)
        h, fn, base, scale = _case(rng, T, D)
        want = _two_kernels(cuda_ready, h, fn, base, scale)
        scr = {}
        args = [cuda_ready.to_device(a) for a in (h, fn, base, scale)]
        first = tuple(a.copy_to_host() for a in hc_mixes(*args, **KW, scratch=scr))
        (counter,) = [a for k, a in scr.items() if k[0] == "hc_mix_counter"]
        assert counter.copy_to_host().tolist() == [0]
        again = tuple(a.copy_to_host() for a in hc_mixes(*args, **KW, scratch=scr))
        assert counter.copy_to_host().tolist() == [0]
        for got in (first, again):
            for g, w in zip(got, want):
                assert np.array_equal(g, w)


def _part_sums_kernel():
    """A kernel whose thread i returns part i % FIN_PARTS of mix i // FIN_PARTS (_part_sum_device) of token 0."""
    from kernels.hc import FIN_PARTS, _part_sum_device

    @cuda.jit
    def part_sums(partial, n_blk, out):
        i = cuda.threadIdx.x
        out[i] = _part_sum_device(partial, 0, i // FIN_PARTS, i % FIN_PARTS, n_blk)
    return part_sums


@pytest.mark.parametrize("n_blk", [161, 160, 82, 37, 7])   # V4.1's 160 blocks (one batch of PART_LOADS a part),
                                                             # one past them (a second batch), ragged
def test_part_sums_in_block_order(cuda_ready, n_blk):
    """The finishing sums add part p's partials b = p, p + FIN_PARTS, ... one by one in that order, whatever loads
    are in flight: bit for bit against that sequence in float64, on values whose sum depends on the order."""
    from kernels.hc import FIN_PARTS, N_ACC
    rng = np.random.default_rng(n_blk)
    partial = rng.standard_normal((1, n_blk, N_ACC)) * 10.0 ** rng.uniform(-8, 8, (1, n_blk, N_ACC))
    out = cuda_ready.device_array(N_ACC * FIN_PARTS, np.float64)
    _part_sums_kernel()[1, N_ACC * FIN_PARTS](cuda_ready.to_device(partial), n_blk, out)
    want = np.zeros(N_ACC * FIN_PARTS)
    for i in range(N_ACC * FIN_PARTS):
        s = 0.0
        for b in range(i % FIN_PARTS, n_blk, FIN_PARTS):
            s += float(partial[0, b, i // FIN_PARTS])
        want[i] = s
    got = out.copy_to_host()
    assert np.array_equal(got.view(np.uint64), want.view(np.uint64))


def _part_pairs_kernel():
    """A kernel whose thread i of THREADS returns flat parts i + 2 THREADS r and i + 2 THREADS r + THREADS for r =
    0, 1, ... (_part_sum_pair_device, the fused kernel's last block); a second part past the last is not stored."""
    from kernels.hc import THREADS, _part_sum_pair_device

    @cuda.jit
    def part_pairs(partial, n_blk, out):
        i = cuda.threadIdx.x
        while i < out.shape[0]:
            s0, s1 = _part_sum_pair_device(partial, i, i + THREADS, n_blk)
            out[i] = s0
            if i + THREADS < out.shape[0]:
                out[i + THREADS] = s1
            i += 2 * THREADS
    return part_pairs


@pytest.mark.parametrize("T,n_blk", [(1, 160), (1, 161), (2, 37), (3, 7), (1, 1)])
def test_part_pairs_in_block_order(cuda_ready, T, n_blk):
    """The fused kernel's last block sums two parts at once (their loads together): each part still adds its
    partials b = p, p + FIN_PARTS, ... one by one in that order, for parts in one token or across two, a second part
    past the last (T = 1: 200 parts over 128 threads), one and two batches of loads, and a single block."""
    from kernels.hc import FIN_PARTS, N_ACC, THREADS
    rng = np.random.default_rng(T * 1000 + n_blk)
    partial = rng.standard_normal((T, n_blk, N_ACC)) * 10.0 ** rng.uniform(-8, 8, (T, n_blk, N_ACC))
    n = T * N_ACC * FIN_PARTS
    out = cuda_ready.to_device(np.full(n, np.nan))          # a part left unwritten fails the comparison
    _part_pairs_kernel()[1, THREADS](cuda_ready.to_device(partial), n_blk, out)
    want = np.zeros(n)
    for i in range(n):
        t, q = divmod(i, N_ACC * FIN_PARTS)
        s = 0.0
        for b in range(q % FIN_PARTS, n_blk, FIN_PARTS):
            s += float(partial[t, b, q // FIN_PARTS])
        want[i] = s
    assert np.array_equal(out.copy_to_host().view(np.uint64), want.view(np.uint64))


def test_hc_empty(cuda_ready):
    from kernels.hc import hc_pre
    h = np.zeros((0, 4, 8), np.float32)
    assert hc_pre(h, np.zeros((0, 4), np.float32)).shape == (0, 8)


def test_last_block_tickets_are_acquire_release_atomics_without_sc_fences():
    """Compiled for sm_90: the last-block kernels (hc's fused mixes, q4_K's split rows, the integer path's output
    staged by the second block of a pair, on the imma and the dp4a kernel) take their ticket with kernels.ticket's
    acquire-release atomic, once a block, and keep no sequentially consistent fence (`membar.gl` / `fence.sc`, what
    cuda.threadfence emits)."""
    from kernels.ticket import TICKET_PTX
    from tests.kernels.compile_sm90 import ptx_counts
    names = ["hc:hc_mix_fused_kernel", "q4k_gemv:q4k_mma_kernel", "q4k_gemv:q4k_imma_t1s_kernel",
             "q4k_dp4a:q4k_dp_t1s_kernel"]
    r = ptx_counts(names, [TICKET_PTX, "membar.gl", "fence.sc"])
    got = {t: (v["sm90"], v[TICKET_PTX], v["membar.gl"], v["fence.sc"]) for t, v in r.items()}
    assert got == {n: (True, 1, 0, 0) for n in names}, got
