"""The perturbation floor's helper: one BF16 ulp at a seeded fraction of the first post-mix's elements, then restored."""
import numpy as np
import pytest

import ds4lib.ref.model as ref_model
from ds4lib.eval.sensitivity import first_post_mix_perturbed
from ds4lib.formats.floats import round_bf16


@pytest.fixture
def identity_post_mix(monkeypatch):
    """hc_post replaced by one that returns h as it is, so that what the wrapper adds is all that changes."""
    monkeypatch.setattr(ref_model, "hc_post", lambda y, h, post, comb: h)
    return ref_model.hc_post


def _h(seed=0):
    return round_bf16(np.random.default_rng(seed).standard_normal((64, 4, 96)).astype(np.float32) + 3.0)


def test_moves_a_seeded_fraction_by_one_ulp_on_the_first_call_only(identity_post_mix):
    h = _h()
    with first_post_mix_perturbed(0.05, seed=7):
        first = ref_model.hc_post(None, h, None, None)
        second = ref_model.hc_post(None, h, None, None)
    with first_post_mix_perturbed(0.05, seed=7):
        again = ref_model.hc_post(None, h, None, None)
    hit = first != h
    assert 0.03 < hit.mean() < 0.07
    ulp = np.abs(h) * 2.0 ** -8          # |h| in [2, 4) is mostly one binade: one step is 2^-7 or 2^-6
    assert np.all(np.abs(first - h)[hit] <= 2 * ulp[hit])
    assert np.array_equal(round_bf16(first), first)
    assert np.array_equal(second, h)
    assert np.array_equal(again, first)   # the same seed in a new block: the same elements and signs


def test_fraction_zero_changes_nothing_and_other_seeds_differ(identity_post_mix):
    h = _h(1)
    with first_post_mix_perturbed(0.0):
        assert np.array_equal(ref_model.hc_post(None, h, None, None), h)
    with first_post_mix_perturbed(0.1, seed=1):
        a = ref_model.hc_post(None, h, None, None)
    with first_post_mix_perturbed(0.1, seed=2):
        b = ref_model.hc_post(None, h, None, None)
    assert not np.array_equal(a, b)


def test_restores_hc_post_after_an_error_and_refuses_bad_fractions(identity_post_mix):
    with pytest.raises(RuntimeError, match="inside"):
        with first_post_mix_perturbed(0.5):
            assert ref_model.hc_post is not identity_post_mix
            raise RuntimeError("inside")
    assert ref_model.hc_post is identity_post_mix
    for bad in (-0.1, 1.5):
        with pytest.raises(ValueError, match="outside"):
            with first_post_mix_perturbed(bad):
                pass
    assert ref_model.hc_post is identity_post_mix
