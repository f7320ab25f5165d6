"""kernels/moe.py against ds4lib.ref.moe (router and the SwiGLU step)."""
import numpy as np
import pytest

from ds4lib.config import ModelConfig
from ds4lib.formats.floats import f32_to_bf16_bits, round_bf16
from ds4lib.ref.linear import linear_q
from ds4lib.ref.moe import expert_ffn, route as ref_route
from tests.kernels.tolerances import assert_matches

CFG = ModelConfig.tiny()


@pytest.mark.parametrize("T,E,delta", [(1, CFG.n_routed_experts, False),   # decode
                                       (2, 40, True),                       # ragged: 40 experts, sidecar bias
                                       (1, 384, True)])                     # V4.1's 384: 3 per scoring thread
def test_route_matches_ref(cuda_ready, T, E, delta):
    from kernels.moe import route
    rng = np.random.default_rng(E)
    D, K = CFG.dim, CFG.n_activated_experts
    x = round_bf16(rng.standard_normal((T, D)))
    gate = round_bf16(rng.standard_normal((E, D)) * 0.05)
    gate[7] = gate[3]                                             # exact ties: lower id first
    bias = (rng.standard_normal(E) * 0.1).astype(np.float32)
    bias[7] = bias[3] = 5.0                                       # ... and both chosen first
    bd = (rng.standard_normal(E) * 0.05).astype(np.float32) if delta else None
    if bd is not None:
        bd[7] = bd[3]                                             # the tie kept under the sidecar delta
    want = ref_route(x, gate, bias, CFG, K, bias_delta=bd)
    scores, ids, w = route(cuda_ready.to_device(x), cuda_ready.to_device(f32_to_bf16_bits(gate)),
                           cuda_ready.to_device(bias), K, CFG.route_scale,
                           bias_delta=None if bd is None else cuda_ready.to_device(bd))
    assert_matches("router_scores", scores.copy_to_host(), want.scores, bf16=False)
    np.testing.assert_array_equal(ids.copy_to_host(), want.ids)
    assert_matches("router_weights", w.copy_to_host(), want.weights, bf16=False)
    assert (want.ids[:, :2] == [3, 7]).all()


@pytest.mark.parametrize("routed", [True, False])
def test_swiglu_matches_expert_ffn(cuda_ready, routed):
    """The kernel's output is the activation expert_ffn feeds its down projection: check through w2 = I."""
    from kernels.moe import swiglu
    rng = np.random.default_rng(int(routed))
    n, F = 3, 80                                                  # 240 elements: a ragged last block
    x = round_bf16(rng.standard_normal((n, F)))
    eye = np.eye(F, dtype=np.float32)
    w1 = round_bf16(rng.standard_normal((F, F)) * 2.0)             # gate: many beyond the limit of 10
    w3 = round_bf16(rng.standard_normal((F, F)) * 2.0)
    wts = rng.random(n).astype(np.float32) if routed else None
    g = linear_q(x, w1, False)
    u = linear_q(x, w3, False)
    want = expert_ffn(x, w1, eye, w3, CFG.swiglu_limit, False, weights=wts)   # w2 = I: the activation itself
    got = swiglu(cuda_ready.to_device(g), cuda_ready.to_device(u), CFG.swiglu_limit,
                 weights=None if wts is None else cuda_ready.to_device(wts)).copy_to_host()
    assert_matches("swiglu", got, want)
    assert (np.abs(g) > CFG.swiglu_limit).any()
