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
                                       (1, 384, True),                      # V4.1's 384: 3 per scoring thread
                                       (1, 512, False)])                    # the most: 4 a thread
def test_route_matches_ref(cuda_ready, T, E, delta):
    """Ids exact, ties to the lower id (within a warp, and across warps and a thread's experts: 3, 7 and 200)."""
    from kernels.moe import route
    rng = np.random.default_rng(E)
    D, K = CFG.dim, CFG.n_activated_experts
    x = round_bf16(rng.standard_normal((T, D)))
    gate = round_bf16(rng.standard_normal((E, D)) * 0.05)
    tied = [3, 7, 200] if E > 200 else [3, 7]                     # 200: thread 72 (warp 2), its second expert
    gate[tied] = gate[3]                                          # exact ties: lower id first
    bias = (rng.standard_normal(E) * 0.1).astype(np.float32)
    bias[tied] = 5.0                                              # ... and all chosen first
    bd = (rng.standard_normal(E) * 0.05).astype(np.float32) if delta else None
    if bd is not None:
        bd[tied] = bd[3]                                          # the tie kept under the sidecar delta
    want = ref_route(x, gate, bias, CFG, K, bias_delta=bd)
    scores, ids, w = route(cuda_ready.to_device(x), cuda_ready.to_device(f32_to_bf16_bits(gate)),
                           cuda_ready.to_device(bias), K, CFG.route_scale,
                           bias_delta=None if bd is None else cuda_ready.to_device(bd))
    assert_matches("router_scores", scores.copy_to_host(), want.scores, bf16=False)
    np.testing.assert_array_equal(ids.copy_to_host(), want.ids)
    assert_matches("router_weights", w.copy_to_host(), want.weights, bf16=False)
    assert (want.ids[:, :len(tied)] == tied).all()


def _choice_by_score_then_id(scores, sel, K, route_scale, normalise=True):
    """The documented choice of one token: K rounds, each the untaken expert of largest selection score that is a
    number, the lower id first on ties; a round with none gives id 0x7FFFFFFF and the last expert's score as its
    weight. Weights: the scores of the chosen, over (their sum in selection order + 1e-20), times route_scale."""
    E = len(sel)
    taken = np.isnan(sel)
    ids, got = [], []
    for _ in range(K):
        live = np.flatnonzero(~taken)
        if len(live) == 0:
            ids.append(0x7FFFFFFF)
            got.append(scores[E - 1])
            continue
        best = live[np.flatnonzero(sel[live] == sel[live].max())[0]]       # the lower id among equal values
        taken[best] = True
        ids.append(best)
        got.append(scores[best])
    total = np.float32(0.0)
    for g in got:
        total = np.float32(total + g)
    w = [np.float32(g / np.float32(total + np.float32(1e-20))) if normalise and K > 1 else g for g in got]
    return np.array(ids, np.int32), np.array([np.float32(v * np.float32(route_scale)) for v in w], np.float32)


@pytest.mark.parametrize("E,K,case", [(384, 6, "ties"),       # V4.1: a lane's 12 experts, ties across lanes / slots
                                      (512, 16, "ties"),      # E_MAX and K_MAX
                                      (160, 6, "nan"),        # NaN and -inf scores among the best
                                      (40, 16, "few")])       # fewer numbers than K: the no-number rounds
def test_route_chooses_by_score_then_id(cuda_ready, E, K, case):
    """The one-launch decode router (256 threads a block) and the per-token kernel (two tokens: 128 threads) choose
    as _choice_by_score_then_id says, bit for bit: equal selection scores go to the lower id wherever the experts sit
    (one lane's slots, other lanes, other scoring threads), NaN is never chosen, -inf is chosen after every number."""
    from kernels.moe import route
    rng = np.random.default_rng(E + K)
    D = 64
    x = cuda_ready.to_device(round_bf16(rng.standard_normal((2, D))).astype(np.float32))
    gate = cuda_ready.to_device(np.zeros((E, D), np.uint16))          # logits 0: every score the same
    levels = np.float32([0.0, 0.25, 0.5])
    bias = levels[rng.integers(0, 3, E)]                              # three values: ties everywhere
    bias[[5, 37, 101 % E, 133 % E]] = 1.0                             # ids 5 and 37: one lane, slots 0 and 1
    if case == "nan":
        bias[[2, 40, 77]] = np.nan
        bias[9] = 2.0                                                 # the best ...
        bias[150] = np.nan                                            # ... and one that would beat it, NaN
        bias[[3, 4]] = -np.inf
        bias[bias == 0.5] = -np.inf                                   # -inf among the first K
    if case == "few":
        bias[:] = np.nan
        bias[[11, 3, 30]] = [0.25, -np.inf, 0.25]                     # three numbers for K = 16
    for T in (1, 2):
        scores, ids, w = (a.copy_to_host() for a in route(x[:T], gate, cuda_ready.to_device(bias), K, 2.5))
        for t in range(T):
            sel = (scores[t] + bias).astype(np.float32)
            want_ids, want_w = _choice_by_score_then_id(scores[t], sel, K, 2.5)
            np.testing.assert_array_equal(ids[t], want_ids, err_msg=f"T={T} token {t}")
            np.testing.assert_array_equal(w[t].view(np.uint32), want_w.view(np.uint32), err_msg=f"T={T} token {t}")
    if case == "few":
        assert (ids[0, 3:] == 0x7FFFFFFF).all() and list(ids[0, :3]) == [11, 30, 3]
    else:
        assert len(set(ids[0].tolist())) == K and ids[0, 0] in (5, 9)


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


# ------------------------------------------------------------------- fused forms: the chain's bits, not ref's
def _bits(a):
    return np.ascontiguousarray(a).view(np.uint32)


@pytest.mark.parametrize("n,F,routed", [(1, 64, False),     # shared expert, decode
                                        (3, 96, True),      # routed rows; 288 elements: a ragged last block
                                        (2, 1024, True)])
def test_swiglu_with_out_q_is_swiglu_then_act_quant(cuda_ready, n, F, routed):
    """g and u as the two halves of one [n, 2F] GEMV output (strided views); rows of zeros and of wide dynamic
    range; out bit-identical to swiglu alone, out_q to act_quant_fp8 of it."""
    from kernels.gemv import act_quant_fp8
    from kernels.moe import swiglu
    rng = np.random.default_rng(n * 1000 + F)
    gu = round_bf16(rng.standard_normal((n, 2 * F)) * 4)
    gu[0, :F:5] = 0.0
    if n >= 2:
        gu[1] = round_bf16(rng.standard_normal(2 * F) * np.exp2(rng.integers(-20, 8, 2 * F)))
        gu[1, 32:64] = 0.0                                           # a zero block: the amax floor
    wts = (rng.random(n) * np.exp2(rng.integers(-8, 2, n))).astype(np.float32) if routed else None
    d_gu = cuda_ready.to_device(gu)
    g, u = d_gu[:, :F], d_gu[:, F:]
    d_w = None if wts is None else cuda_ready.to_device(wts)
    want = swiglu(cuda_ready.to_device(np.ascontiguousarray(gu[:, :F])),
                  cuda_ready.to_device(np.ascontiguousarray(gu[:, F:])), CFG.swiglu_limit, weights=d_w)
    want_q = act_quant_fp8(want).copy_to_host()
    want = want.copy_to_host()
    np.testing.assert_array_equal(_bits(swiglu(g, u, CFG.swiglu_limit, weights=d_w).copy_to_host()), _bits(want))
    out_q = cuda_ready.device_array((n, F), np.float32)
    got = swiglu(g, u, CFG.swiglu_limit, weights=d_w, out_q=out_q).copy_to_host()
    np.testing.assert_array_equal(_bits(got), _bits(want))
    np.testing.assert_array_equal(_bits(out_q.copy_to_host()), _bits(want_q))
    assert not np.array_equal(want_q, want)                          # the quantiser did something


@pytest.mark.parametrize("n,F", [(1, 64), (3, 96), (2, 1024)])
def test_swiglu_stages_the_integer_operand_as_im_stage(cuda_ready, n, F):
    """`im=` (the shared expert's SwiGLU, for w2): out and out_q bit-equal to swiglu with out_q alone, and the
    integer path's digits and (p, sum) pairs bit-equal to kernels.q4k_gemv.im_stage of out_q (quantize=False), the
    launch it replaces, into arrays of all-ones words (an unwritten word shows); g and u strided halves of one GEMV
    output, a zero block and rows of wide dynamic range included."""
    from tests.kernels.filled import filled
    from kernels.im_operand import im_stage_shapes
    from kernels.moe import swiglu
    from kernels.q4k_gemv import im_stage
    rng = np.random.default_rng(n * 100 + F)
    gu = round_bf16(rng.standard_normal((n, 2 * F)) * np.exp2(rng.integers(-14, 4, (n, 2 * F))))
    gu[0, 32:64] = 0.0
    d_gu = cuda_ready.to_device(gu)
    g, u = d_gu[:, :F], d_gu[:, F:]
    outs = [cuda_ready.device_array((n, F), np.float32) for _ in range(4)]
    swiglu(g, u, CFG.swiglu_limit, out=outs[0], out_q=outs[1])
    got_im = filled(cuda_ready, im_stage_shapes(n, F), 0xFFFFFFFF)
    swiglu(g, u, CFG.swiglu_limit, out=outs[2], out_q=outs[3], im=got_im)
    want_im = im_stage(outs[1], quantize=False, out=filled(cuda_ready, im_stage_shapes(n, F), 0x7F7F7F7F))
    for i in (0, 1):
        np.testing.assert_array_equal(_bits(outs[i + 2].copy_to_host()), _bits(outs[i].copy_to_host()))
    for gi, e in zip(got_im, want_im):
        np.testing.assert_array_equal(gi.copy_to_host().view(np.uint32), e.copy_to_host().view(np.uint32))
    pairs = want_im[1].copy_to_host()
    assert np.isfinite(pairs).all() and (pairs[1::2] != 0).any() and (pairs[1::2] == 0).any()


@pytest.mark.parametrize("E,K", [(CFG.n_routed_experts, CFG.n_activated_experts),
                                 (40, 16),                             # K_MAX, ragged experts
                                 (160, 6)])                            # 5 experts a lane
def test_route_writes_the_vq_plan_of_one_token(cuda_ready, E, K):
    """route(plan=...) leaves scores, ids and weights bit-identical and writes vq_plan(ids, E)'s arrays."""
    from kernels.moe import route
    from kernels.vq_gemv import TILE_MAX, vq_plan
    rng = np.random.default_rng(E * 100 + K)
    D = CFG.dim
    x = round_bf16(rng.standard_normal((1, D)))
    gate = cuda_ready.to_device(f32_to_bf16_bits(round_bf16(rng.standard_normal((E, D)) * 0.05)))
    bias = cuda_ready.to_device((rng.standard_normal(E) * 0.1).astype(np.float32))
    d_x = cuda_ready.to_device(x)
    want = [a.copy_to_host() for a in route(d_x, gate, bias, K, CFG.route_scale)]
    want_plan = vq_plan(cuda_ready.to_device(want[1]), E, tile_rows=min(K, TILE_MAX))
    plan = want_plan._replace(pairs=cuda_ready.to_device(np.full(K, -1, np.int32)),     # -1: nothing written yet
                              tiles=cuda_ready.to_device(np.full((K, 3), -1, np.int32)),
                              n_tiles=cuda_ready.to_device(np.full(1, -1, np.int32)))
    got = [a.copy_to_host() for a in route(d_x, gate, bias, K, CFG.route_scale, plan=plan)]
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g.view(np.uint32), w.view(np.uint32))
    assert not np.array_equal(want[1][0], np.sort(want[1][0]))       # selection order is not id order
    n = int(want_plan.n_tiles.copy_to_host()[0])
    assert n == K and int(plan.n_tiles.copy_to_host()[0]) == n
    np.testing.assert_array_equal(plan.pairs.copy_to_host(), want_plan.pairs.copy_to_host())
    np.testing.assert_array_equal(plan.tiles.copy_to_host(), want_plan.tiles.copy_to_host())


@pytest.mark.parametrize("E,K,delta", [(CFG.n_routed_experts, CFG.n_activated_experts, False),   # 8 rows a block
                                       (384, 6, True)])      # V4.1's experts: 48 blocks under one ticket
def test_route_in_the_gate_gemv_equals_gemv_then_route(cuda_ready, monkeypatch, E, K, delta):
    """One token: route_gemv_kernel (the gate's GEMV, the last block routing) gives the bits of kernels.gemv then
    route_topk_kernel (scores, ids, weights, the plan and the logits), twice in a row (its ticket counter is left
    zero for the next call)."""
    import kernels.moe as moe
    from kernels.vq_gemv import TILE_MAX, vq_plan
    rng = np.random.default_rng(E + K)
    D = 512
    x = cuda_ready.to_device(round_bf16(rng.standard_normal((1, D))).astype(np.float32))
    gate = cuda_ready.to_device(f32_to_bf16_bits(round_bf16(rng.standard_normal((E, D)) * 0.05)))
    bias = cuda_ready.to_device((rng.standard_normal(E) * 0.1).astype(np.float32))
    bd = cuda_ready.to_device((rng.standard_normal(E) * 0.05).astype(np.float32)) if delta else None
    ids0 = cuda_ready.to_device(np.arange(K, dtype=np.int32).reshape(1, K))
    assert moe.route_in_gemv(x, gate)

    def run(fused):
        monkeypatch.setattr(moe, "ROUTE_IN_GEMV", fused)
        key = ("logits", (1, E), np.dtype(np.float32).str)
        scratch = {}
        plan = vq_plan(ids0, E, tile_rows=min(K, TILE_MAX))
        got = []
        for _ in range(2 if fused else 1):
            scratch[key] = cuda_ready.to_device(np.full((1, E), np.nan, np.float32))    # routing too early shows
            out = moe.route(x, gate, bias, K, CFG.route_scale, bias_delta=bd, plan=plan, scratch=scratch)
            got.append([a.copy_to_host() for a in (*out, plan.pairs, plan.tiles, plan.n_tiles)]
                       + [scratch[key].copy_to_host()])
        if fused:
            assert int(scratch[("route_counter", (1,), np.dtype(np.int32).str)].copy_to_host()[0]) == 0
        return got
    want, got = run(False), run(True)
    for g_call in got:
        for g, w in zip(g_call, want[0]):
            np.testing.assert_array_equal(g.view(np.uint32), w.view(np.uint32))
    assert len(set(want[0][1][0])) == K                     # K distinct experts chosen


def test_fused_moe_steps_refuse_bad_arguments(cuda_ready):
    """Checked before any launch."""
    from kernels.im_operand import im_stage_shapes
    from kernels.moe import route, swiglu
    from kernels.vq_gemv import vq_plan
    f32 = lambda *s: np.zeros(s, np.float32)                        # noqa: E731
    with pytest.raises(ValueError):
        swiglu(f32(2, 80), f32(2, 80), 10.0, out_q=f32(2, 80))      # F % 32 != 0
    with pytest.raises(ValueError):
        swiglu(f32(2, 64), f32(2, 64), 10.0, out_q=f32(1, 64))      # out_q shape
    with pytest.raises(ValueError):
        swiglu(f32(2, 64), f32(2, 64), 10.0, out_q=np.zeros((2, 64)))   # out_q dtype
    with pytest.raises(ValueError):
        swiglu(f32(2, 64), f32(2, 32), 10.0)                         # u shape
    im = tuple(np.zeros(sh, dt) for sh, dt in im_stage_shapes(2, 64))
    with pytest.raises(ValueError):
        swiglu(f32(2, 64), f32(2, 64), 10.0, im=im)                  # im without out_q
    with pytest.raises(ValueError):
        swiglu(f32(2, 64), f32(2, 64), 10.0, out_q=f32(2, 64), im=im[::-1])          # im's arrays swapped
    with pytest.raises(ValueError):
        swiglu(f32(1, 64), f32(1, 64), 10.0, out_q=f32(1, 64), im=im)                # im for two rows
    E, K, D = 16, 4, 64
    gate, bias = np.zeros((E, D), np.uint16), f32(E)
    plan = vq_plan(cuda_ready.to_device(np.arange(2 * K, dtype=np.int32).reshape(2, K)), E)
    with pytest.raises(ValueError):
        route(f32(2, D), gate, bias, K, 1.0, plan=plan)                # two tokens: the plan kernel's job
    plan1 = vq_plan(cuda_ready.to_device(np.arange(K, dtype=np.int32).reshape(1, K)), E)
    with pytest.raises(ValueError):
        route(f32(1, D), gate, bias, K - 1, 1.0, plan=plan1)           # plan for another K
    with pytest.raises(ValueError):
        route(f32(1, D), np.zeros((E + 1, D), np.uint16), f32(E + 1), K, 1.0, plan=plan1)   # another E
    with pytest.raises(ValueError):
        route(f32(1, D), gate, bias, K, 1.0, plan=tuple(plan1))        # not a VQPlan
