"""Self-consistency of the reference (docs/architecture.md §14) on a seeded random tiny checkpoint."""
import numpy as np
import pytest

from ds4lib.config import ModelConfig
from ds4lib.engram_geometry import engram_geometry
from ds4lib.formats.names import HEAD
from ds4lib.ref import ReferenceModel
from ds4lib.ref.engram import DEAD, engram_hashes
from ds4lib.ref.hc import hc_mixes, sinkhorn
from ds4lib.ref.indexer import candidate_blocks, select_topk
from ds4lib.ref.linear import linear_f32
from ds4lib.ref.norm import rms_norm
from ds4lib.synth import write_random_checkpoint


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return write_random_checkpoint(tmp_path_factory.mktemp("rand") / "ckpt", ModelConfig.tiny(), seed=7)


@pytest.mark.parametrize("quant_sim", [True, False])
def test_prefill_decode_chunked_identical(tiny_dir, quant_sim):
    m = ReferenceModel.load(tiny_dir, quant_sim=quant_sim)
    ids = np.random.default_rng(11).integers(3, 1000, 60)
    seen = {}
    full = m.forward(ids, m.new_state(), observer=lambda l, n, v: seen.__setitem__((l, n), np.array(v))).logits
    # the prompt slides the window and leaves more compressed rows than top-k, candidates active
    cfg = m.cfg
    assert len(ids) > 2 * cfg.window_size
    assert (seen[(2, "topk")][-1] >= 0).sum() == cfg.index_topk and 60 // 2 > cfg.index_topk
    assert seen[(4, "candidates")][-1].sum() < 60
    st = m.new_state()
    one = np.concatenate([m.forward(ids[i:i + 1], st).logits for i in range(len(ids))])
    st = m.new_state()
    chunks = np.concatenate([m.forward(ids[a:b], st).logits for a, b in ((0, 7), (7, 20), (20, 60))])
    np.testing.assert_array_equal(one, full)
    np.testing.assert_array_equal(chunks, full)
    np.testing.assert_array_equal(m.logits(ids, chunk=13), full)


def test_sinkhorn_sums():
    rng = np.random.default_rng(0)
    c = sinkhorn(rng.standard_normal((50, 4, 4)).astype(np.float32), 20, 1e-6)
    np.testing.assert_allclose(c.sum(axis=-2), 1, atol=2e-6)   # the eps terms leave ~1e-6
    np.testing.assert_allclose(c.sum(axis=-1), 1, atol=1e-2)   # 20 iterations: rows close, not exact
    assert (c > 0).all()


def test_hc_mixes_shapes_and_ranges(tiny_dir):
    m = ReferenceModel.load(tiny_dir)
    w = m.w.layer(0)
    h = np.random.default_rng(1).standard_normal((5, 4, 256)).astype(np.float32)
    pre, post, comb = hc_mixes(h, w["hc_attn_fn"], w["hc_attn_base"], w["hc_attn_scale"], norm_eps=1e-20,
                               hc_eps=1e-6, iters=20)
    assert pre.shape == (5, 4) and post.shape == (5, 4) and comb.shape == (5, 4, 4)
    assert (pre > 0).all() and (pre < 1 + 1e-5).all() and (post > 0).all() and (post < 2).all()


def test_indexer_topk_against_brute_force():
    rng = np.random.default_rng(2)
    T, S, k = 30, 40, 8
    scores = rng.standard_normal((T, S)).astype(np.float32)
    reach = np.arange(T) + 5
    masked = np.where(np.arange(S)[None] < reach[:, None], scores, -np.inf)
    got = select_topk(masked, reach, k)
    for t in range(T):
        valid = got[t][got[t] >= 0]
        r = min(reach[t], S)
        want = np.sort(np.argsort(-masked[t][:r], kind="stable")[:min(k, r)])
        np.testing.assert_array_equal(valid, want)
        assert np.all(np.diff(valid) > 0)
    # fewer reachable rows than k: all of them, padded with -1
    few = select_topk(masked[:1], np.array([3]), k)
    np.testing.assert_array_equal(few[0], [0, 1, 2, -1, -1, -1, -1, -1])


def test_candidate_blocks_pin_newest_and_drop_unreachable():
    scores = np.full((1, 20), -np.inf, np.float32)
    scores[0, :17] = np.linspace(1, 0, 17)           # old rows score higher
    mask = candidate_blocks(scores, np.array([17]), 2, 4)
    # best block is 0 (rows 0-3); the newest reachable row 16 sits in block 4, which is pinned
    np.testing.assert_array_equal(np.nonzero(mask[0])[0], [0, 1, 2, 3, 16, 17, 18, 19])
    none = candidate_blocks(np.full((1, 8), -np.inf, np.float32), np.array([0]), 3, 4)
    assert not none.any()


def test_engram_dead_token_blocks_ngrams():
    cfg = ModelConfig.tiny()
    g = engram_geometry(cfg)
    hist = np.full(3, -2)
    base, _ = engram_hashes(np.array([5, 6, 7, 8]), hist, g, pad_cid=2)
    dead, _ = engram_hashes(np.array([5, DEAD, 7, 8]), hist, g, pad_cid=2)
    # position 3's 2-gram (7,8) does not span the dead token; its 3- and 4-grams do, and see pads
    np.testing.assert_array_equal(dead[3, :, :2], base[3, :, :2])
    ref, _ = engram_hashes(np.array([2, 2, 7, 8]), np.full(3, 2), g, pad_cid=2)
    np.testing.assert_array_equal(dead[3, :, 2:], ref[3, :, 2:])
    # history carries across calls: hashing in two calls equals one call
    a, h2 = engram_hashes(np.array([5, 6]), hist, g, 2)
    b, _ = engram_hashes(np.array([7, 8]), h2, g, 2)
    np.testing.assert_array_equal(np.concatenate([a, b]), base)


def test_dspark_proposal_of_length_one_is_head_plus_markov(tiny_dir):
    m = ReferenceModel.load(tiny_dir)
    ids = np.random.default_rng(3).integers(3, 1000, 20)
    st = m.new_state()
    out = m.forward(ids, st)
    m.dspark_append(st, out.features, np.arange(len(ids)))
    anchor = int(out.logits[-1].argmax())
    collapsed = []
    orig = m._block

    def spy(l, w, h, pre, attend, observer):
        h2, pre2 = orig(l, w, h, pre, attend, observer)
        collapsed.append((h2, pre2))
        return h2, pre2
    m._block = spy
    prop = m.dspark_propose(st, anchor, len(ids) - 1)
    h, pre = collapsed[-1]
    wl = m.w.layer(m.cfg.n_all_layers - 1)
    y = np.einsum("ts,tsd->td", pre, h)
    from ds4lib.formats.floats import round_bf16
    base = linear_f32(rms_norm(round_bf16(y), wl["norm.weight"], m.cfg.norm_eps), m.w.global_(HEAD))
    bias = linear_f32(wl["markov_head.embed.weight"][anchor][None], wl["markov_head.head.weight"])[0]
    assert prop.tokens[0] == anchor
    assert prop.tokens[1] == int(np.argmax(base[0] + bias))
    np.testing.assert_allclose(prop.logits[0], base[0] + bias, rtol=1e-6, atol=1e-5)


def test_observation_points_rebuild_the_moe_output(tiny_dir):
    m = ReferenceModel.load(tiny_dir)
    obs = {}
    m.forward(np.arange(3, 23), m.new_state(), observer=lambda l, n, v: obs.__setitem__((l, n), np.array(v)))
    for l in (0, 5):
        y = (obs[(l, "ye")] * obs[(l, "router_weights")][..., None]).sum(1) + obs[(l, "ysh")]
        np.testing.assert_allclose(y, obs[(l, "moe_out")], rtol=0, atol=np.abs(y).max() * 2 ** -7)
        assert obs[(l, "block_in")].shape == (20, 4, 256) and obs[(l, "router_scores")].shape == (20, 32)


def test_bad_tokens_are_refused(tiny_dir):
    m = ReferenceModel.load(tiny_dir)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        m.forward([5, 5000], m.new_state())
    with pytest.raises(ValueError, match="non-empty"):
        m.forward([], m.new_state())
