"""kernels/q4k_dp4a.py: the dp4a one-token kernel gives q4k_imma_t1_kernel's bits (kernels.q4k_gemv), and its dp4a
primitives the exact byte dot products."""
import numpy as np
import pytest
from numba import cuda                  # the simulator swaps this global inside kernels (conftest chose the mode)

from ds4lib.formats.q4k import dequantize_q4k, quantize_q4k
from ds4lib.ref.linear import linear_f32
from kernels.q4k_dp4a import dp4a_us_device, dp4a_uu_device
from tests.kernels.tolerances import assert_matches


def _q4k(rng, n, k):
    w = rng.standard_normal((n, k)).astype(np.float32) * 0.05
    w *= np.exp2(rng.integers(-6, 6, (n, 1))).astype(np.float32)
    w[0, :256] = 0.0                                        # a dead super-block: all-zero bytes
    return quantize_q4k(w)


def _deq(q):
    return dequantize_q4k(q)


def _both(cuda_mod, monkeypatch, x, q, stage_out=None, kernel=None, **kw):
    """(dp4a kernel's output, imma kernel's output) of one q4k_gemv call, each checked to have taken its kernel;
    `stage_out`: a function giving each call its stage_out operands; `kernel`: the one-token dp4a kernel to use."""
    import kernels.q4k_dp4a as dp
    import kernels.q4k_gemv as qk
    d_x, d_q = cuda_mod.to_device(x), cuda_mod.to_device(q)
    runs = []
    for use in (True, False):
        monkeypatch.setattr(qk, "USE_DP4A", use)
        taken = []
        for name in ("q4k_dp_t1_kernel", "q4k_dp_t1s_kernel"):
            kern = kernel if kernel is not None and name == "q4k_dp_t1_kernel" else getattr(dp, name)
            monkeypatch.setattr(dp, name, _Spy(kern, taken))
        extra = {} if stage_out is None else {"stage_out": stage_out()}
        runs.append(qk.q4k_gemv(d_x, d_q, quantize=False, **extra, **kw).copy_to_host())
        assert bool(taken) == use
        monkeypatch.undo()
    return runs


class _Spy:
    """A kernel stand-in that records its launches and runs the kernel."""
    def __init__(self, kernel, log):
        self.kernel, self.log, self.tiles = kernel, log, kernel.tiles

    def __getitem__(self, cfg):
        self.log.append(cfg)
        return self.kernel[cfg]


@pytest.mark.parametrize("rows,nb,out_bf16,tiles,x_shared", [
    (40, 10, False, 1, True), (16, 1, True, 1, True), (24, 5, False, 1, True), (20, 7, True, 1, True),
    (40, 10, False, 2, True), (24, 5, True, 2, True), (40, 10, False, 1, False), (24, 5, True, 2, False)])
def test_dp4a_kernel_gives_the_imma_kernels_bits(cuda_ready, monkeypatch, rows, nb, out_bf16, tiles, x_shared):
    """One token on the integer path through the dp4a kernel (`tiles` 16-row tiles a block; the digits copied into
    shared memory or read where staged: `x_shared`) and through
    q4k_imma_t1_kernel: the same bits, for K quarters of 3, 3, 3, 1 (nb 10), one busy warp (1), 2, 2, 1, 0 (5) and
    2, 2, 2, 1 (7), over tail tiles (40, 24 and 20 rows; with two tiles a block, the last block's second tile past
    the end or partly), rows whose scales differ by up to 2^11 and activations across 2^-20 .. 2^20; and within
    linear_f32's tolerance."""
    import kernels.q4k_dp4a as dp
    rng = np.random.default_rng(rows * 100 + nb)
    k = 256 * nb
    q = _q4k(rng, rows, k)
    x = (rng.standard_normal((1, k)) * np.exp2(rng.integers(-20, 20, (1, k // 32))).repeat(32, axis=1))
    x = x.astype(np.float32)
    kernel = dp._make_dp_kernel(tiles=tiles, x_shared=x_shared)
    got, want = _both(cuda_ready, monkeypatch, x, q, out_bf16=out_bf16, kernel=kernel)
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
    if not out_bf16:
        assert_matches("gemv_f32", got, linear_f32(x, _deq(q)), bf16=False)


def test_two_tile_blocks_need_one_group_a_block(cuda_ready):
    """A block of two 16-row tiles shares one copy of the digits, so it only takes matrices whose groups hold whole
    blocks (rows_per_group a multiple of 32, or all rows); a 16-row group takes the imma kernel (dp_fits)."""
    import kernels.q4k_dp4a as dp
    w = cuda_ready.to_device(np.zeros((64, 144), np.uint8))
    two, one = dp._make_dp_kernel(tiles=2), dp.q4k_dp_t1s_kernel
    assert dp.dp_fits(two, w, 64, 64) and dp.dp_fits(two, w, 64, 32) and not dp.dp_fits(two, w, 64, 16)
    assert dp.dp_fits(one, w, 64, 16) and dp.dp_fits(one, w, 40, 40)
    with pytest.raises(ValueError, match="one tile"):
        dp._make_dp_kernel(stage=True, tiles=2)


@pytest.mark.parametrize("tiles,x_shared", [(1, True), (2, True), (1, False)])
def test_dp4a_kernel_grouped_rows_and_non_finite_blocks(cuda_ready, monkeypatch, tiles, x_shared):
    """Grouped rows (wo_a's: 16-row tiles reading their group's slice of x; `tiles` of them a block; the digits
    copied into shared memory or read where staged) give the imma kernel's bits; an infinity in one block of a
    group's slice makes exactly that group's rows NaN on both kernels."""
    import kernels.q4k_dp4a as dp
    kernel = dp._make_dp_kernel(tiles=tiles, x_shared=x_shared)
    rng = np.random.default_rng(5)
    G, R, Kg = 3, 32, 256 * 3
    q = _q4k(rng, G * R, Kg)
    x = (rng.standard_normal((1, G * Kg)) * 3).astype(np.float32)
    got, want = _both(cuda_ready, monkeypatch, x, q, out_bf16=False, rows_per_group=R, kernel=kernel)
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
    assert_matches("gemv_f32", got, np.concatenate([linear_f32(x[:, g * Kg:(g + 1) * Kg], _deq(q[g * R:(g + 1) * R]))
                                                    for g in range(G)], axis=1), bf16=False)
    x[0, Kg + 300] = np.inf
    got, want = _both(cuda_ready, monkeypatch, x, q, out_bf16=False, rows_per_group=R, kernel=kernel)
    assert np.isnan(got[0, R:2 * R]).all() and np.isnan(want[0, R:2 * R]).all()
    assert not np.isnan(got[0, :R]).any() and not np.isnan(got[0, 2 * R:]).any()
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    keep = ~np.isnan(got)
    np.testing.assert_array_equal(got[keep].view(np.uint32), want[keep].view(np.uint32))


@pytest.mark.parametrize("out_bf16", [True, False])
def test_dp4a_staging_kernel_gives_the_imma_staging_bits(cuda_ready, monkeypatch, out_bf16):
    """With stage_out (wo_a's output staged for wo_b) the dp4a kernel writes the imma staging kernel's output and
    staged operands, bit for bit (96 rows: three blocks of 32, each staged by the second of its two 16-row blocks)."""
    from kernels.im_operand import im_stage_shapes
    rng = np.random.default_rng(8 + out_bf16)
    G, R, Kg = 2, 48, 512
    q = _q4k(rng, G * R, Kg)
    x = rng.standard_normal((1, G * Kg)).astype(np.float32)
    staged = []

    def stage_out():
        arrs = tuple(cuda_ready.to_device(np.full(shape, 0x5A5A5A5A, np.uint32).view(dtype))
                     for shape, dtype in im_stage_shapes(1, G * R))
        staged.append(arrs)
        return arrs
    got, want = _both(cuda_ready, monkeypatch, x, q, out_bf16=out_bf16, rows_per_group=R, stage_out=stage_out)
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
    for a, b in zip(*staged):
        np.testing.assert_array_equal(a.copy_to_host().view(np.uint32), b.copy_to_host().view(np.uint32))


@cuda.jit
def _dp4a_kernel(a, b, c, out):
    i = cuda.grid(1)
    if i < a.size:
        out[i, 0] = dp4a_uu_device(a[i], b[i], c[i])
        out[i, 1] = dp4a_us_device(a[i], b[i], c[i])


def test_dp4a_primitives_are_the_exact_byte_dot_products(cuda_ready):
    """dp4a_uu / dp4a_us: c plus the four byte products, b's bytes unsigned / signed (0x80 is -128, 0xFF is -1),
    against NumPy, on extreme and random words."""
    rng = np.random.default_rng(3)
    a = np.concatenate([[0xFFFFFFFF, 0x0F0F0F0F, 0xF0F0F0F0, 0], rng.integers(0, 2 ** 32, 60)]).astype(np.uint32)
    b = np.concatenate([[0x80808080, 0xFFFFFFFF, 0x7F80FF01, 0x12345678], rng.integers(0, 2 ** 32, 60)])
    b = b.astype(np.uint32)
    c = rng.integers(-2 ** 20, 2 ** 20, a.size).astype(np.int32)
    out = cuda_ready.to_device(np.zeros((a.size, 2), np.int32))
    _dp4a_kernel[1, 64](cuda_ready.to_device(a), cuda_ready.to_device(b), cuda_ready.to_device(c), out)
    ab = a.view(np.uint8).reshape(-1, 4).astype(np.int64)
    bu = b.view(np.uint8).reshape(-1, 4).astype(np.int64)
    bs = b.view(np.int8).reshape(-1, 4).astype(np.int64)
    want = np.stack([(ab * bu).sum(1) + c, (ab * bs).sum(1) + c], axis=1)
    np.testing.assert_array_equal(out.copy_to_host(), want)
