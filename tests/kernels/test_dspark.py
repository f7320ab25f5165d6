"""kernels/dspark.py against the reference: the context features (ds4lib.ref.model.run_layer's BF16 stream mean) and
the Markov logits of one draft position (ds4lib.ref.dspark.draft_tokens' base + bias). Both are exact."""
import numpy as np
import pytest

from ds4lib.formats.floats import round_bf16
from tests.kernels.tolerances import assert_matches


@pytest.mark.parametrize("T,D,col0,F", [(1, 32, 0, 96), (5, 32, 64, 96), (3, 40, 40, 80)])
def test_features_equal_the_reference_mean(cuda_ready, T, D, col0, F):
    from kernels.dspark import dspark_features
    cuda = cuda_ready
    rng = np.random.default_rng(T * 100 + D)
    h = (rng.standard_normal((T, 4, D)) * np.exp(rng.uniform(-8, 8, (T, 4, D)))).astype(np.float32)
    out = cuda.to_device(np.full((T, F), 7.0, np.float32))
    dspark_features(cuda.to_device(h), col0, out)
    got = out.copy_to_host()
    assert_matches("dspark_features", got[:, col0:col0 + D], round_bf16(h.mean(axis=1, dtype=np.float32)))
    np.testing.assert_array_equal(np.delete(got, np.s_[col0:col0 + D], axis=1), 7.0)     # other columns untouched
    with pytest.raises(ValueError):
        dspark_features(cuda.to_device(h), F - D + 1, out)


def test_markov_add_is_the_fp32_sum(cuda_ready):
    from kernels.dspark import markov_add
    cuda = cuda_ready
    rng = np.random.default_rng(1)
    base = rng.standard_normal((4, 300)).astype(np.float32)
    bias = rng.standard_normal((1, 300)).astype(np.float32)
    out = cuda.device_array(300, np.float32)
    for row in range(4):
        markov_add(cuda.to_device(base), row, cuda.to_device(bias), out)
        assert_matches("markov_add", out.copy_to_host(), base[row] + bias[0])


def test_table_rows_gathers_exact_rows(cuda_ready):
    from kernels.dspark import table_rows
    cuda = cuda_ready
    table = np.random.default_rng(2).standard_normal((50, 16)).astype(np.float32)
    ids = np.array([3, 49, 0, 3], dtype=np.int64)
    out = cuda.device_array((4, 16), np.float32)
    table_rows(cuda.to_device(table), cuda.to_device(ids), out)
    np.testing.assert_array_equal(out.copy_to_host(), table[ids])
