"""ds4lib.ref.sampling: the RNG, exact truncation, the sampled distribution, determinism."""
import numpy as np
import pytest

from ds4lib.ref import sampling as S


def test_philox_known_answers():
    """Random123's philox4x32_10 known-answer vectors."""
    cases = [((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
             ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
             ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
              (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1))]
    for ctr, key, want in cases:
        got = S.philox4x32(np.array(ctr, np.uint64), np.array(key, np.uint64))
        assert [int(v) for v in got] == list(want)


def test_uniforms_open_interval_and_counter_based():
    u = S.uniforms(seed=12345, step=7, n=100_000)
    assert (u > 0).all() and (u < 1).all()
    assert abs(u.mean() - 0.5) < 0.005 and abs(u.var() - 1 / 12) < 0.002
    np.testing.assert_array_equal(S.uniforms(12345, 7, 10), u[:10])           # a prefix of the same stream
    assert not np.array_equal(S.uniforms(12345, 8, 10), u[:10])
    assert not np.array_equal(S.uniforms(12346, 7, 10), u[:10])
    big = S.uniforms(2**40 + 3, 2**33 + 1, 4)                                  # 64-bit seeds and steps
    assert (big > 0).all() and (big < 1).all()


def test_top_k_keeps_ties_and_top_p_is_the_smallest_prefix():
    l = np.array([3.0, 2.0, 2.0, 1.0, 0.0, -np.inf], np.float32)
    assert S.kept_mask(l, temperature=1.0, top_k=2).tolist() == [True, True, True, False, False, False]
    assert S.kept_mask(l, temperature=1.0, top_k=1).tolist() == [True] + [False] * 5
    # four tied maxima of exactly weight 2^32 each: any top_p keeps the whole group (mass above it is 0)
    t = np.array([1.0, 1.0, 1.0, 1.0, 0.0], np.float32)
    assert S.kept_mask(t, temperature=1.0, top_p=0.01).tolist() == [True] * 4 + [False]
    # mass strictly above token 1 is W0 = 2^32 exactly; keep it iff that is below P = top_p * total
    _, W = S.fixed_weights(l, 1.0)
    total = float(W.sum())
    p_edge = float(W[0]) / total
    assert not S.kept_mask(l, temperature=1.0, top_p=p_edge)[1]
    assert S.kept_mask(l, temperature=1.0, top_p=np.nextafter(p_edge, 1))[1]
    # top_p after top_k: P comes from the top-k mass only
    both = S.kept_mask(l, temperature=1.0, top_k=3, top_p=0.99)
    assert both.tolist() == [True, True, True, False, False, False]


def test_min_p_and_temperature():
    l = np.log(np.array([0.5, 0.3, 0.15, 0.05], np.float64)).astype(np.float32)
    assert S.kept_mask(l, temperature=1.0, min_p=0.25).tolist() == [True, True, True, False]
    assert S.kept_mask(l, temperature=0.5, min_p=0.25).tolist() == [True, True, False, False]   # sharper
    p = S.probabilities(l, temperature=1.0)
    np.testing.assert_allclose(p, [0.5, 0.3, 0.15, 0.05], rtol=1e-6)
    assert S.sample(np.array([1, 5, 5, 2], np.float32), temperature=0) == 1                   # first argmax


@pytest.mark.parametrize("params", [dict(temperature=1.0), dict(temperature=0.7, top_k=4),
                                   dict(temperature=1.3, top_p=0.8), dict(temperature=1.0, min_p=0.1)])
def test_frequencies_match_probabilities(params):
    rng = np.random.default_rng(0)
    l = (rng.standard_normal(7) * 1.5).astype(np.float32)
    p = S.probabilities(l, **params)
    n = 12_000
    counts = np.bincount([S.sample(l, seed=99, step=s, **params) for s in range(n)], minlength=len(l))
    assert counts[p == 0].sum() == 0                                          # truncation is never violated
    sigma = np.sqrt(n * p * (1 - p)) + 1e-9
    assert np.all(np.abs(counts - n * p) <= 4.5 * sigma), (counts, n * p)
    chi2 = np.sum((counts[p > 0] - n * p[p > 0]) ** 2 / (n * p[p > 0]))
    assert chi2 < 30                                                          # <= 6 dof: p ~ 4e-5


def test_determinism_by_seed_and_batch():
    rng = np.random.default_rng(1)
    logits = rng.standard_normal((3, 50)).astype(np.float32)
    a = S.sample_batch(logits, [1, 2, 3], [10, 10, 10], temperature=1.0, top_p=0.95)
    b = S.sample_batch(logits, [1, 2, 3], [10, 10, 10], temperature=1.0, top_p=0.95)
    np.testing.assert_array_equal(a, b)
    draws = {S.sample(logits[0], temperature=1.0, seed=1, step=s) for s in range(40)}
    assert len(draws) > 5
