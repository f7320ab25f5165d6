"""The router selection bias Δb (ds4lib.solvers.router_bias) on synthetic routers with a known offset."""
import numpy as np

from ds4lib.ref.moe import select_experts
from ds4lib.solvers.router_bias import gap_means, same_set_rate, solve_router_bias


def _router(seed=0, T=2000, E=12, K=3, shift=0.3):
    rng = np.random.default_rng(seed)
    scores = rng.uniform(0.5, 1.5, (T, E)).astype(np.float32)
    gate_bias = np.zeros(E, np.float32)
    true = np.zeros(E, np.float32)
    true[:3] = shift            # the original prefers experts 0-2 by `shift`
    ids_orig = select_experts(scores, gate_bias, K, true)
    train = np.arange(T) % 4 != 3
    return scores, gate_bias, ids_orig, train, K


def test_bias_recovers_the_original_preference():
    scores, gb, ids_orig, train, K = _router()
    sol = solve_router_bias(scores=scores, gate_bias=gb, ids_orig=ids_orig, top_k=K, train=train)
    assert sol.bias is not None and sol.alpha in (0.5, 1.0, 1.5, 2.5)
    assert sol.heldout_after > sol.heldout_before + 0.2
    assert (sol.bias[:3] > 0).all() and sol.bias[:3].min() > sol.bias[3:].max()
    ids = select_experts(scores, (gb + sol.bias).astype(np.float32), K)
    assert same_set_rate(ids[~train], ids_orig[~train]) == sol.heldout_after


def test_gap_signs_and_counts():
    scores = np.array([[1.0, 0.9, 0.8, 0.1]], np.float32)
    mean, count = gap_means(scores, np.zeros(4, np.float32), np.array([[0, 3]]), 2)
    # ours {0, 1}, thr = 0.9: expert 3 picked only by the original (+0.8), expert 1 only by us (0)
    np.testing.assert_allclose(mean, [0, 0, 0, 0.8], atol=1e-6)
    np.testing.assert_array_equal(count, [0, 1, 0, 1])


def test_same_routing_writes_nothing():
    scores, gb, _, train, K = _router(shift=0.0)
    ids = select_experts(scores, gb, K)
    sol = solve_router_bias(scores=scores, gate_bias=gb, ids_orig=ids, top_k=K, train=train)
    assert sol.bias is None and sol.alpha is None and sol.heldout_after == sol.heldout_before == 1.0


def test_experts_need_eight_events():
    scores, gb, ids_orig, train, K = _router(T=40, shift=0.3)
    sol = solve_router_bias(scores=scores, gate_bias=gb, ids_orig=ids_orig, top_k=K, train=train, min_events=10**6)
    assert sol.armed == 0 and sol.bias is None
