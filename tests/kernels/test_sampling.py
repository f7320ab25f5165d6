"""kernels/sampling.py against ds4lib.ref.sampling: the same tokens and the same kept sets, bit for bit."""
import numpy as np
import pytest
from numba import cuda                  # the simulator swaps this global inside kernels (conftest chose the mode)

from ds4lib.ref import sampling as ref
from tests.kernels.compile_sm90 import ptx_counts
from tests.kernels.tolerances import assert_matches


def _logits(rng, B, V):
    """Rows with exact ties (top-k and top-p boundaries fall on tie groups), a -inf token and -0/+0."""
    l = np.round(rng.standard_normal((B, V)) * 3, 1).astype(np.float32)
    l[:, 5] = -np.inf
    l[:, 6], l[:, 7] = 0.0, -0.0
    return l


@pytest.mark.parametrize("params", [
    dict(temperature=0.8, top_k=20, top_p=0.9, min_p=0.02),      # every truncation, top-p on the top-k mass
    dict(temperature=1.0, top_p=0.5),                             # top-p alone, three digit passes
])
def test_sample_matches_ref(cuda_ready, params):
    from kernels.sampling import sample
    rng = np.random.default_rng(len(params))
    B, V = 2, 300                                                 # 3 blocks per row with chunk 128
    l = _logits(rng, B, V)
    seeds = np.array([7, 2**40 + 11], np.int64)
    steps = np.array([0, 123456789], np.int64)
    kept = cuda_ready.to_device(np.zeros((B, V), np.uint8))
    got = sample(cuda_ready.to_device(l), cuda_ready.to_device(seeds), cuda_ready.to_device(steps), chunk=128,
                 kept=kept, **params).copy_to_host()
    want_kept = np.stack([ref.kept_mask(row, **params) for row in l])
    assert_matches("sampling", kept.copy_to_host().astype(bool), want_kept)
    assert_matches("sampling", got, ref.sample_batch(l, seeds, steps, **params))
    assert 1 < want_kept[0].sum() < V


def test_greedy_is_first_argmax(cuda_ready):
    from kernels.sampling import sample
    l = np.zeros((2, 200), np.float32)
    l[0, [17, 150]] = 3.0                                         # tie: the first wins
    l[1, 199] = 1.0                                               # in the last, partial block
    z = cuda_ready.to_device(np.zeros(2, np.int64))
    got = sample(cuda_ready.to_device(l), z, z, temperature=0.0, chunk=128).copy_to_host()
    assert got.tolist() == [17, 199] == ref.sample_batch(l, [0, 0], [0, 0], temperature=0.0).tolist()


def test_philox_device_matches_ref(cuda_ready):
    from kernels.sampling import philox_uniform_device

    @cuda.jit
    def draw(seed, step, out):
        i = cuda.grid(1)
        if i < out.shape[0]:
            out[i] = philox_uniform_device(seed, step, i)

    out = cuda_ready.to_device(np.zeros(40, np.float64))
    draw[1, 64](2**33 + 5, 77, out)
    np.testing.assert_array_equal(out.copy_to_host(), ref.uniforms(2**33 + 5, 77, 40))


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_non_finite_rows_give_token_minus_one(cuda_ready, temperature):
    """A NaN or +inf logit, or a row of -inf only: token -1 on the device where ref raises; finite rows as ref."""
    from kernels.sampling import sample
    l = _logits(np.random.default_rng(9), 4, 300)
    l[0, 250] = np.nan
    l[1, 3] = np.inf
    l[2] = -np.inf
    seeds, steps = np.array([1, 2, 3, 4], np.int64), np.zeros(4, np.int64)
    got = sample(cuda_ready.to_device(l), cuda_ready.to_device(seeds), cuda_ready.to_device(steps), chunk=128,
                 temperature=temperature, top_p=0.9).copy_to_host()
    assert got[:3].tolist() == [-1, -1, -1]
    assert got[3] == ref.sample(l[3], temperature=temperature, top_p=0.9, seed=4, step=0)
    for row in l[:3]:
        with pytest.raises(ref.NonFiniteLogits):
            ref.sample(row, temperature=temperature, top_p=0.9)


def _masks(rng, B, V):
    """~30% of the tokens allowed; row 1 allows three only (fewer than top_k), one in the last, partial block."""
    allowed = rng.random((B, V)) < 0.3
    allowed[1] = False
    allowed[1, [3, 150, V - 1]] = True
    return allowed, ref.token_mask(allowed)


@pytest.mark.parametrize("params", [
    dict(temperature=0.0),
    dict(temperature=0.8, top_k=20, min_p=0.02),                  # top-k counts the masked-out tokens as -inf
    pytest.param(dict(temperature=0.8, top_k=20, top_p=0.9, min_p=0.02), marks=pytest.mark.slow),
])
def test_masked_sample_matches_ref(cuda_ready, params):
    """A token mask (constrained decoding): the same tokens and kept sets as ref on the masked row, bit for bit."""
    from kernels.sampling import sample
    rng = np.random.default_rng(21)
    B, V = 2, 300
    l = _logits(rng, B, V)
    allowed, masks = _masks(rng, B, V)
    seeds = np.array([7, 2**40 + 11], np.int64)
    steps = np.array([0, 123456789], np.int64)
    kept = cuda_ready.to_device(np.zeros((B, V), np.uint8))
    got = sample(cuda_ready.to_device(l), cuda_ready.to_device(seeds), cuda_ready.to_device(steps), chunk=128,
                 mask=cuda_ready.to_device(masks), kept=kept, **params).copy_to_host()
    want = ref.sample_batch(l, seeds, steps, masks=masks, **params)
    assert_matches("sampling", got, want)
    assert all(allowed[b, t] for b, t in enumerate(got))
    assert got.tolist() != ref.sample_batch(l, seeds, steps, **params).tolist()     # the mask changed the draw
    if params["temperature"] > 0:
        want_kept = np.stack([ref.kept_mask(ref.masked_logits(row, m), **params) for row, m in zip(l, masks)])
        assert_matches("sampling", kept.copy_to_host().astype(bool), want_kept)


@pytest.mark.parametrize("temperature", [0.0, pytest.param(0.9, marks=pytest.mark.slow)])
def test_masked_non_finite_rows_give_token_minus_one(cuda_ready, temperature):
    """A NaN outside the mask still marks the row (as ref, which checks the whole row), and so does an allowed set
    whose logits are all -inf."""
    from kernels.sampling import sample
    l = _logits(np.random.default_rng(9), 3, 300)
    allowed = np.zeros((3, 300), bool)
    allowed[:, [20, 260]] = True
    l[0, 250] = np.nan
    l[1, [20, 260]] = -np.inf
    masks = ref.token_mask(allowed)
    seeds, steps = np.array([1, 2, 3], np.int64), np.zeros(3, np.int64)
    got = sample(cuda_ready.to_device(l), cuda_ready.to_device(seeds), cuda_ready.to_device(steps), chunk=128,
                 temperature=temperature, top_p=0.9, mask=cuda_ready.to_device(masks)).copy_to_host()
    assert got[:2].tolist() == [-1, -1]
    assert got[2] == ref.sample(l[2], temperature=temperature, top_p=0.9, seed=3, step=0, mask=masks[2])
    for row, m in zip(l[:2], masks[:2]):
        with pytest.raises(ref.NonFiniteLogits):
            ref.sample(row, temperature=temperature, top_p=0.9, mask=m)


def test_masked_kernels_compile_for_sm90():
    """The three kernels that read the token mask compile for sm_90 without a GPU (test_compile_sm90 compiles every
    kernel; this is the fast check of the ones constrained decoding changed)."""
    r = ptx_counts([f"sampling:{k}" for k in ("sample_max_kernel", "sample_hist_kernel", "sample_gumbel_kernel")], [])
    assert len(r) == 3 and all(v["sm90"] for v in r.values()), r
