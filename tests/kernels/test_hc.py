"""kernels/hc.py against ds4lib.ref.hc (mixes within tolerance; collapse and expand bit-exact)."""
import numpy as np
import pytest

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
                                 (1, 1200)])        # 38 partial blocks: the finishing kernel's 4-load loop
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


def test_hc_empty(cuda_ready):
    from kernels.hc import hc_pre
    h = np.zeros((0, 4, 8), np.float32)
    assert hc_pre(h, np.zeros((0, 4), np.float32)).shape == (0, 8)
