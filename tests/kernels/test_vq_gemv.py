"""kernels/vq_gemv.py against ds4lib.formats.vq (the decoded weight) and ds4lib.ref.linear.linear_q / ds4lib.ref.moe.

Simulator shapes are tiny; two stream geometries are covered: long rows (J = 320 vectors per row: a 256-index block
holds at most two rows, rows straddle blocks, the last group is ragged and its last block lies past the stream)
and short rows (J = 12: a block holds ~21 rows and a lane's 8 positions can straddle a row boundary). 12- and
13-bit layers, T = 1 decode and a two-row tile kernel with T > 1, sidecar gains, empty experts.
"""
import numpy as np
import pytest

from ds4lib.formats.actquant import act_quant_fp8
from ds4lib.formats.floats import f32_to_bf16_bits, round_bf16
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
    from kernels.vq_gemv import vq_codebook
    codes, _, index, plane, gains = layer
    return (vq_codebook(cuda.to_device(codes)), cuda.to_device(index),
            None if plane is None else cuda.to_device(plane),
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


def test_codebook_decode_is_bit_exact(cuda_ready):
    """Every E4M3 code -> the BF16 bits of its exact value (hardware cvt on the GPU, software in the simulator)."""
    from kernels.vq_gemv import vq_codebook
    codes = np.arange(256, dtype=np.uint8).reshape(32, 8)
    got = vq_codebook(cuda_ready.to_device(codes)).copy_to_host().view(np.uint16).reshape(32, 8)
    want = decode_codebook(codes)
    fin = np.isfinite(want)
    np.testing.assert_array_equal(got[fin], f32_to_bf16_bits(want)[fin])
    assert np.isnan(((got[~fin].astype(np.uint32) << 16).view(np.float32))).all()


def test_long_rows_13bit_decode_with_sidecar(cuda_ready):
    """J = 320: rows straddle blocks (partials summed per row), 3 rows of a 4-row group, a block past the stream."""
    from kernels.vq_gemv import vq_gemv, vq_plan
    rng = np.random.default_rng(0)
    n_exp, rows, cols = 3, 3, 2560
    layer = _layer(rng, n_exp, rows, cols, 13)
    dl = _device_layer(cuda_ready, layer)
    ids = np.array([[2, 0]], np.int32)                          # expert 1 is empty
    plan = vq_plan(cuda_ready.to_device(ids), n_exp)
    x = act_quant_fp8(round_bf16(rng.standard_normal((1, cols)) * 3), 32)
    got = vq_gemv(cuda_ready.to_device(x), plan, *dl, mats=(2,), shape=(rows, cols), x_div=2,
                  quantize=False).copy_to_host()
    assert_matches("gemv_bf16", got[0], _want(layer, 2, [x[0], x[0]], ids[0]))
    a = act_quant_fp8(round_bf16(rng.standard_normal((2, cols))), 32)      # w2 reads each pair's own row
    scale = rng.uniform(0.5, 1.5, (n_exp, rows)).astype(np.float32)
    got2 = vq_gemv(cuda_ready.to_device(a), plan, *dl, mats=(1,), shape=(rows, cols), scale=cuda_ready.to_device(scale),
                   quantize=False).copy_to_host()
    assert_matches("gemv_bf16", got2[0], _want(layer, 1, a, ids[0], scale))


@pytest.mark.parametrize("rows, cols, bits", [(3, 2560, 13), (24, 96, 12)])
def test_decode_reads_staged_and_global_activations_alike(cuda_ready, monkeypatch, rows, cols, bits):
    """T = 1: the decode kernel reads the activations from a padded copy in shared memory when they fit, else from
    global memory; both give the same bits (long rows J = 320, and J = 12 where a lane's 8 positions straddle rows)
    and match the reference."""
    import kernels.vq_gemv as vq
    rng = np.random.default_rng(7)
    n_exp = 3
    layer = _layer(rng, n_exp, rows, cols, bits)
    dl = _device_layer(cuda_ready, layer)
    ids = np.array([[2, 0]], np.int32)
    plan = vq.vq_plan(cuda_ready.to_device(ids), n_exp)
    x = cuda_ready.to_device(act_quant_fp8(round_bf16(rng.standard_normal((1, cols)) * 3), 32))
    a = cuda_ready.to_device(act_quant_fp8(round_bf16(rng.standard_normal((2, cols))), 32))
    got = {}
    for limit in (vq.SMEM_LIMIT, 0):                                # 0: nothing fits, lanes read global memory
        monkeypatch.setattr(vq, "SMEM_LIMIT", limit)
        got[limit] = (vq.vq_gemv(x, plan, *dl, mats=(0, 2), shape=(rows, cols), x_div=2, quantize=False),
                      vq.vq_gemv(a, plan, *dl, mats=(1,), shape=(rows, cols), quantize=False))
    (s13, s2), (g13, g2) = ((u.copy_to_host(), v.copy_to_host()) for u, v in got.values())
    np.testing.assert_array_equal(s13, g13)
    np.testing.assert_array_equal(s2, g2)
    xh = x.copy_to_host()
    assert_matches("gemv_bf16", s13[1], _want(layer, 2, [xh[0], xh[0]], ids[0]))
    assert_matches("gemv_bf16", s2[0], _want(layer, 1, a.copy_to_host(), ids[0]))


def test_short_rows_12bit_batch_tiles_and_identity_gain(cuda_ready):
    """J = 12 (rows split inside a lane's 8 positions), T = 3 tokens in two-row tiles; a token's rows equal its T = 1
    result bit for bit; an all-ones sidecar equals none exactly."""
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


def test_13_12_13_bit_layers_in_turn(cuda_ready):
    """A 13-bit layer, a 12-bit layer, then the 13-bit one again through the same kernel (the engine's order):
    on the GPU the dynamic shared-memory limit raised for the 13-bit codebook must not be lowered in between."""
    from kernels.vq_gemv import vq_gemv, vq_plan
    rng = np.random.default_rng(5)
    n_exp, rows, cols = 2, 16, 64
    ids = np.array([[1]], np.int32)
    x = round_bf16(rng.standard_normal((1, cols)))
    layers = {b: _layer(rng, n_exp, rows, cols, b) for b in (13, 12)}
    for bits in (13, 12, 13):
        plan = vq_plan(cuda_ready.to_device(ids), n_exp)
        got = vq_gemv(cuda_ready.to_device(x), plan, *_device_layer(cuda_ready, layers[bits]), mats=(0,),
                      shape=(rows, cols)).copy_to_host()
        assert_matches("gemv_bf16", got[0], _want(layers[bits], 0, [act_quant_fp8(x, 32)[0]], ids[0]))


def test_moe_combine_ascending_expert_order(cuda_ready):
    from kernels.vq_gemv import moe_combine
    rng = np.random.default_rng(2)
    ids = np.array([[5, 1, 3], [0, 7, 2]], np.int32)
    ye = round_bf16(rng.standard_normal((6, 64)) * np.exp2(rng.integers(-8, 8, (6, 64))))
    ysh = round_bf16(rng.standard_normal((2, 64)))
    got = moe_combine(cuda_ready.to_device(ye), cuda_ready.to_device(ids), cuda_ready.to_device(ysh)).copy_to_host()
    want = np.zeros((2, 64), np.float32)
    for t in range(2):
        y = np.zeros(64, np.float32)
        for k in np.argsort(ids[t]):
            y += ye[t * 3 + k]
        want[t] = round_bf16(y + ysh[t])
    np.testing.assert_array_equal(got, want)


def test_bad_arguments(cuda_ready):
    from kernels.vq_gemv import vq_gemv, vq_plan
    rng = np.random.default_rng(3)
    _, _, index, _, gains = _layer(rng, 2, 8, 64, 12)
    dl = (cuda_ready.to_device(np.zeros((4096, 2), np.uint64)), cuda_ready.to_device(index), None,
          tuple(cuda_ready.to_device(np.ascontiguousarray(gains[:, m]).view(np.uint16)) for m in range(3)))
    plan = vq_plan(cuda_ready.to_device(np.array([[0]], np.int32)), 2)
    x = cuda_ready.to_device(np.zeros((1, 64), np.float32))
    with pytest.raises(ValueError):
        vq_gemv(x, plan, *dl, mats=(0,), shape=(8, 96))              # stream size does not fit the shape
    with pytest.raises(ValueError):
        vq_gemv(x, plan, dl[0], dl[1], cuda_ready.to_device(np.zeros((2, 3, 128), np.uint8)), dl[3], mats=(0,),
                shape=(8, 64))                                        # a plane with a 4096-entry codebook
    with pytest.raises(ValueError):
        vq_plan(cuda_ready.to_device(np.zeros((1, 2), np.int64)), 2)


def test_sm90_ptx_has_no_local_memory_and_uses_the_hardware_e4m3_decode():
    """Compiled for sm_90 without a GPU: the GEMV keeps its activations and accumulators in registers, and the
    codebook decoder uses cvt.rn.f16x2.e4m3x2."""
    r = ptx_counts([f"vq_gemv:{k}" for k in ("vq_gemv_t1_kernel", "vq_gemv_t2_kernel", "vq_codebook_kernel")],
                   [".local", "cvt.rn.f16x2.e4m3x2", "fma.rn.f32"])
    for k in ("vq_gemv_t1_kernel", "vq_gemv_t2_kernel"):
        v = r[f"vq_gemv:{k}"]
        assert v["sm90"] and v[".local"] == 0 and v["fma.rn.f32"] >= 48, r
    v = r["vq_gemv:vq_codebook_kernel"]
    assert v["cvt.rn.f16x2.e4m3x2"] >= 1 and v[".local"] == 0, r


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
