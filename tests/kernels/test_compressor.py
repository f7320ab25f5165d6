"""kernels/compressor.py against ds4lib.ref.compressor.compress over a sequence of calls (state carried)."""
import numpy as np

from ds4lib.config import ModelConfig
from ds4lib.formats.floats import round_bf16
from ds4lib.ref.compressor import Pending, compress as ref_compress
from ds4lib.ref.linear import linear_bf16, linear_f32
from tests.kernels.tolerances import assert_matches

CFG = ModelConfig.tiny()
D, DH = CFG.dim, CFG.head_dim


def _weights(rng):
    return {"attn.compressor.wkv.weight": round_bf16(rng.standard_normal((DH, D)) * 0.06),
            "attn.compressor.wgate.weight": round_bf16(rng.standard_normal((DH, D)) * 0.06),
            "attn.compressor.norm.weight": round_bf16(1 + 0.1 * rng.standard_normal(DH))}


def test_ratio2_sequence_of_calls(cuda_ready):
    """Prefill with a trailing odd token, decode completing a group, decode leaving one pending, a chunk."""
    from kernels.compressor import compress
    rng = np.random.default_rng(2)
    w = _weights(rng)
    pending = Pending(DH)
    s_kv = cuda_ready.to_device(np.zeros((2, DH), np.float32))
    s_sc = cuda_ready.to_device(np.full((2, DH), -np.inf, np.float32))
    d_norm = cuda_ready.to_device(w["attn.compressor.norm.weight"])
    pos = 0
    for T in (5, 1, 1, 3):
        x = round_bf16(rng.standard_normal((T, D)))
        want, gids = ref_compress(x, w, CFG, 2, pos, pending)
        kv = linear_f32(x, w["attn.compressor.wkv.weight"])
        sc = linear_f32(x, w["attn.compressor.wgate.weight"])
        positions = cuda_ready.to_device(np.arange(pos, pos + T, dtype=np.int64))
        got = compress(cuda_ready.to_device(kv), cuda_ready.to_device(sc), s_kv, s_sc, positions, 2, d_norm,
                       CFG.norm_eps, n_groups=len(gids) + 1)          # one row more than completed: zero
        rows, gpos = _group_rows(cuda_ready, positions, 2, len(gids) + 1)
        np.testing.assert_array_equal(rows, list(gids) + [-1])
        np.testing.assert_array_equal(gpos[:len(gids)], np.asarray(gids) * 2)
        got = got.copy_to_host()
        assert not got[len(gids):].any()
        assert_matches("compress", got[:len(gids)], want)
        pos += T
        slots = np.arange(pos - len(pending.kv), pos) % 2                # the incomplete group's rows
        np.testing.assert_array_equal(s_kv.copy_to_host()[slots], pending.kv)
        np.testing.assert_array_equal(s_sc.copy_to_host()[slots], pending.score)


def test_ratio1_pass_through(cuda_ready):
    from kernels.compressor import compress
    rng = np.random.default_rng(3)
    w = _weights(rng)
    x = round_bf16(rng.standard_normal((3, D)))
    want, gids = ref_compress(x, w, CFG, 1, 7, Pending(DH))
    kv = linear_bf16(x, w["attn.compressor.wkv.weight"])
    positions = cuda_ready.to_device(np.arange(7, 10, dtype=np.int64))
    got = compress(cuda_ready.to_device(kv), None, None, None, positions, 1,
                   cuda_ready.to_device(w["attn.compressor.norm.weight"]), CFG.norm_eps, n_groups=3)
    rows, gpos = _group_rows(cuda_ready, positions, 1, 3)
    np.testing.assert_array_equal(rows, gids)
    np.testing.assert_array_equal(gpos, gids)
    assert gids[0] == 7
    assert_matches("compress", got.copy_to_host(), want)


def _group_rows(cuda, positions, ratio, n):
    """kernels.step.group_rows: the cache slot and RoPE position of each latent row."""
    from kernels.step import group_rows
    rows, gpos = cuda.device_array(n, np.int64), cuda.device_array(n, np.int64)
    group_rows(positions, ratio, rows, gpos)
    return rows.copy_to_host(), gpos.copy_to_host()
