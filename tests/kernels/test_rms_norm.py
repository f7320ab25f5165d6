import numpy as np

from ds4lib.formats.floats import round_bf16
from ds4lib.ref.norm import rms_norm as rms_norm_ref


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
