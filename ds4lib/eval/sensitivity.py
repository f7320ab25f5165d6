"""The perturbation floor: how far one-ulp BF16 changes move the CPU reference's own top-1.

Any backend whose arithmetic is not bit-identical to the CPU reference (the CUDA engine's FP8 tensor-core GEMVs,
other summation orders) differs from it by rounding-sized amounts. In a chaotic forward those grow through the
layers and across positions. So a top-1 agreement figure only means something next to the reference's agreement
with itself under a perturbation of that size.

`first_post_mix_perturbed(fraction, seed)` moves the output of the first mHC post-mix call inside a `with` block
(the first of the forward run there: layer 0, after attention, [T, 4, D]) by one BF16 ulp, with a random sign, at a
random `fraction` of its elements (seeded). It does this by wrapping `ds4lib.ref.model.hc_post` for the duration of
the block: run one forward a block. Used by bench/bench_sensitivity.py and by the CUDA engine's top-1 test.
"""
from __future__ import annotations

from contextlib import contextmanager

import numpy as np

import ds4lib.ref.model as ref_model
from ds4lib.formats.floats import round_bf16

__all__ = ["first_post_mix_perturbed"]


class _FirstPostMix:
    """Wraps hc_post; perturbs its first call."""

    def __init__(self, orig, fraction: float, seed: int):
        self.orig, self.fraction = orig, fraction
        self.calls, self.rng = 0, np.random.default_rng(seed)

    def __call__(self, y, h, post, comb):
        out = self.orig(y, h, post, comb)
        self.calls += 1
        if self.fraction and self.calls == 1:
            hit = self.rng.random(out.shape) < self.fraction
            step = np.abs(out) * np.float32(2.0 ** -8) * np.sign(self.rng.standard_normal(out.shape))
            out = np.where(hit, round_bf16(out + step), out).astype(np.float32)
        return out


@contextmanager
def first_post_mix_perturbed(fraction: float, seed: int = 0):
    """Within the block, the CPU reference's first post-mix is perturbed as the module docstring says."""
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"fraction {fraction} is outside [0, 1]")
    orig = ref_model.hc_post
    wrap = _FirstPostMix(orig, fraction, seed)
    ref_model.hc_post = wrap
    try:
        yield
    finally:
        ref_model.hc_post = orig
