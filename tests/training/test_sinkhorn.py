"""The trainer's Sinkhorn: the loop equals the reference's NumPy math, and the fused GPU operator (Triton)
equals the loop in value and gradient. The fused test needs CUDA and Triton; under DS4_REQUIRE_CUDA=1 a
missing GPU or Triton fails it instead of skipping."""
from __future__ import annotations

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from ds4lib.ref.hc import sinkhorn as ref_sinkhorn           # noqa: E402
from training import sinkhorn as S                            # noqa: E402


def test_loop_equals_the_reference():
    c = np.random.default_rng(0).standard_normal((64, 4, 4)).astype(np.float32) * 3
    got = S.sinkhorn_loop(torch.from_numpy(c), 20, 1e-6).numpy()
    ref = ref_sinkhorn(c, 20, 1e-6)
    np.testing.assert_allclose(got, ref, rtol=2e-6, atol=1e-7)
    # it ends column-normalised (rows are only approximately normalised after 20 iterations)
    np.testing.assert_allclose(got.sum(-2), 1, atol=1e-5)
    assert np.abs(got.sum(-1) - 1).max() < 0.1


def test_cpu_uses_the_loop():
    c = torch.randn(8, 4, 4)
    assert not S.fused_available(c)
    torch.testing.assert_close(S.sinkhorn(c, 20, 1e-6), S.sinkhorn_loop(c, 20, 1e-6), rtol=0, atol=0)


def _need_gpu():
    ok = S.triton is not None and torch.cuda.is_available()
    if not ok:
        if os.environ.get("DS4_REQUIRE_CUDA", "0") not in ("", "0"):
            pytest.fail("DS4_REQUIRE_CUDA=1 but no CUDA device or no Triton for the fused Sinkhorn")
        pytest.skip("fused Sinkhorn needs CUDA and Triton")


@pytest.mark.parametrize("iters", [1, 3, 20])
def test_fused_equals_the_loop_in_value_and_gradient(iters):
    _need_gpu()
    gen = torch.Generator().manual_seed(iters)
    c = (torch.randn(2, 1000, 4, 4, generator=gen) * 3).cuda()
    w = torch.randn(2, 1000, 4, 4, generator=gen).cuda()
    a, b = c.clone().requires_grad_(True), c.clone().requires_grad_(True)
    ya = S.sinkhorn_loop(a, iters, 1e-6)
    (ya * w).sum().backward()
    yb = S.sinkhorn(b, iters, 1e-6)
    (yb * w).sum().backward()
    assert S.fused_available(b)
    torch.testing.assert_close(yb, ya, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-5)


def test_fused_inside_a_compiled_graph():
    _need_gpu()
    c = torch.randn(300, 4, 4, device="cuda", requires_grad=True)
    f = torch.compile(lambda x: (S.sinkhorn(x, 20, 1e-6) ** 2).sum(), dynamic=False)
    f(c).backward()
    g = c.grad.clone()
    c.grad = None
    (S.sinkhorn_loop(c, 20, 1e-6) ** 2).sum().backward()
    torch.testing.assert_close(g, c.grad, rtol=1e-4, atol=1e-5)


def test_self_check_reports():
    _need_gpu()
    r = S.self_check(iters=20, eps=1e-6)
    assert r["fused"] and r["rel_forward"] < 1e-5 and r["rel_grad"] < 1e-4, r
