"""kernels/engram.py against ds4lib.ref.engram and the checkpoint's FP8 row decoding."""
import numpy as np
import pytest

from ds4lib.config import ModelConfig
from ds4lib.engram_geometry import engram_geometry
from ds4lib.formats.floats import round_bf16
from ds4lib.formats.fp8 import e4m3_decode, ue8m0_decode
from ds4lib.ref.engram import DEAD, engram_apply, engram_hashes as ref_hashes
from ds4lib.ref.linear import linear_q
from tests.kernels.tolerances import assert_matches

CFG = ModelConfig.tiny()


def test_hashes_prefill_then_decode(cuda_ready):
    """A prompt with a DEAD (image) token, then two decode steps that read the carried history."""
    from kernels.engram import engram_hashes
    geo = engram_geometry(CFG)
    primes, offsets, mults = (cuda_ready.to_device(a) for a in geo.arrays())
    pad = 5
    rng = np.random.default_rng(0)
    hist_ref = np.full(geo.max_ngram - 1, -2, dtype=np.int64)
    d_hist = cuda_ready.to_device(hist_ref)
    for cids in (np.array([3, 17, DEAD, 40, 41, 600, 723], np.int64),
                 rng.integers(0, CFG.engram_compressed_vocab_size, 1), np.array([DEAD], np.int64)):
        want, hist_ref = ref_hashes(cids, hist_ref, geo, pad)
        got, d_hist = engram_hashes(cuda_ready.to_device(cids), d_hist, primes, offsets, mults, geo.n_heads, pad)
        assert_matches("engram_hash", got.copy_to_host(), want)
        assert_matches("engram_hash", d_hist.copy_to_host(), hist_ref)


def test_gather_decodes_fp8_rows(cuda_ready):
    from kernels.engram import engram_gather
    rng = np.random.default_rng(1)
    R, hd = 50, 64                                                    # two scales per row
    codes = rng.integers(0, 256, (R, hd)).astype(np.uint8)            # every code, NaN (0x7F/0xFF) included
    scales = rng.integers(110, 140, (R, hd // 32)).astype(np.uint8)
    scales[0, 0], scales[1, 1], scales[2, 0] = 0, 255, 1              # 2^-127, NaN, 2^-126
    hashes = np.array([[0, 1, 2], [49, 7, 7]], np.int64)
    want = round_bf16(e4m3_decode(codes) * np.repeat(ue8m0_decode(scales), 32, axis=-1))[hashes]
    got = engram_gather(cuda_ready.to_device(hashes), cuda_ready.to_device(codes), cuda_ready.to_device(scales))
    assert_matches("engram_gather", got.copy_to_host(), want)


@pytest.mark.parametrize("D", [CFG.dim, 1152])   # 1152: two batches of four a thread, then one element
def test_gate_matches_engram_apply(cuda_ready, D):
    """h [T, 4, D] plus the gated value; the second token is DEAD (gate closed), one stream has a zero dot."""
    from kernels.engram import engram_gate
    rng = np.random.default_rng(2)
    T, S, C, hd = 2, CFG.hc_mult, 4, 32
    h = round_bf16(rng.standard_normal((T, S, D)))
    rows = round_bf16(rng.standard_normal((T, C, hd)))
    w = {"engram.wkv.weight": round_bf16(rng.standard_normal(((S + 1) * D, C * hd)) * 0.05),
         "engram.q_weight": round_bf16(1 + 0.1 * rng.standard_normal((S, D))),
         "engram.k_weight": round_bf16(1 + 0.1 * rng.standard_normal((S, D)))}
    w["engram.q_weight"][1] = 0.0                                      # dot = +0 -> gate sigmoid(+1e-3)
    dead = np.array([False, True])
    want = engram_apply(h, rows, w, CFG, True, dead=dead)
    kv = linear_q(rows.reshape(T, -1), w["engram.wkv.weight"], True)
    got = engram_gate(cuda_ready.to_device(h), cuda_ready.to_device(kv), cuda_ready.to_device(w["engram.q_weight"]),
                      cuda_ready.to_device(w["engram.k_weight"]), CFG.norm_eps,
                      dead=cuda_ready.to_device(dead.astype(np.uint8))).copy_to_host()
    assert_matches("engram_gate", got, want)
    np.testing.assert_array_equal(got[1], h[1])                      # DEAD: unchanged
