"""kernels/indexer.py against ds4lib.ref.indexer (scores, top-k and candidate blocks, all bit-exact)."""
import numpy as np
import pytest

from ds4lib.config import ModelConfig
from ds4lib.formats.actquant import act_quant_fp4_pow2
from ds4lib.formats.floats import f32_to_bf16_bits, round_bf16
from ds4lib.ref.indexer import candidate_blocks as ref_candidates
from ds4lib.ref.indexer import index_scores as ref_scores
from ds4lib.ref.indexer import reach, select_topk as ref_topk
from ds4lib.ref.linear import linear_bf16, linear_q
from ds4lib.ref.rope import apply_rope, rope_freqs
from tests.kernels.tolerances import assert_matches

CFG = ModelConfig.tiny()
NI, DI = CFG.index_n_heads, CFG.index_head_dim
FREQS = rope_freqs(CFG.rope_head_dim, CFG.compress_rope_theta, True, CFG.original_seq_len, CFG.rope_factor,
                   CFG.beta_fast, CFG.beta_slow)


def test_index_scores_bit_exact(cuda_ready):
    """A query at position 597 (ratio 2: reach 299 of 300 rows, 2 blocks), FP4-simulated as in the model, with a
    candidate mask on blocks of 4 positions (a consumer layer)."""
    from kernels.indexer import index_scores
    rng = np.random.default_rng(1)
    T, S, ratio, bsize = 1, 300, 2, 4
    w = {"attn.indexer.wq_b.weight": round_bf16(rng.standard_normal((NI * DI, CFG.q_lora_rank)) * 0.1),
         "attn.indexer.weights_proj.weight": round_bf16(rng.standard_normal((NI, CFG.dim)) * 0.1)}
    x = round_bf16(rng.standard_normal((T, CFG.dim)))
    qr = round_bf16(rng.standard_normal((T, CFG.q_lora_rank)))
    P = np.array([597], dtype=np.int64)
    keys = act_quant_fp4_pow2(round_bf16(rng.standard_normal((S, DI))), 32)
    cand = (rng.random((T, S // bsize)) < 0.7).astype(np.uint8)
    want = ref_scores(x, qr, w, CFG, keys, P, ratio, FREQS, True)
    want = np.where(np.repeat(cand.astype(bool), bsize, axis=1), want, -np.inf)
    # the kernel's inputs, from the reference's own steps
    q = act_quant_fp4_pow2(apply_rope(linear_q(qr, w["attn.indexer.wq_b.weight"], True).reshape(T, NI, DI), P,
                                      FREQS), 32)
    wts = linear_bf16(x, w["attn.indexer.weights_proj.weight"])
    got = index_scores(cuda_ready.to_device(q), cuda_ready.to_device(wts), DI ** -0.5 * NI ** -0.5,
                       cuda_ready.to_device(f32_to_bf16_bits(keys)), cuda_ready.to_device(P), ratio,
                       cand=cuda_ready.to_device(cand), cand_block=bsize).copy_to_host()
    assert_matches("index_scores", got, want)
    assert np.isfinite(got).sum() > 100 and np.isneginf(got[0, 299])


def _tied_scores(rng, T, S, n_levels=6):
    """BF16 scores with many exact ties, -0.0 and +0.0, and -inf (masked) entries."""
    levels = round_bf16(np.concatenate([rng.standard_normal(n_levels - 2), [0.0, -0.0]]))
    sc = levels[rng.integers(0, n_levels, (T, S))].astype(np.float32)
    sc[rng.random((T, S)) < 0.2] = -np.inf
    return sc


@pytest.mark.parametrize("T,S,k,chunk", [(1, 700, 64, 128),      # 6 selection blocks, ties across blocks
                                         (3, 40, 8, 4096),       # decode-size row, k < reach
                                         (2, 5, 8, 128)])        # fewer rows than k: -1 padding
def test_select_topk_matches_ref(cuda_ready, T, S, k, chunk):
    from kernels.indexer import select_topk
    rng = np.random.default_rng(S)
    sc = _tied_scores(rng, T, S)
    P = rng.integers(0, 2 * S + 2, T).astype(np.int64)
    P[0] = 2 * S + 1                                              # one query sees every row
    P[-1] = 0 if T > 2 else P[-1]                                 # and one sees none: all -1
    want = ref_topk(sc, reach(P, 2), k)                          # width min(k, S)
    got = select_topk(cuda_ready.to_device(sc), k, positions=cuda_ready.to_device(P), ratio=2,
                      chunk=chunk).copy_to_host()
    assert_matches("topk", got[:, :want.shape[1]], want.astype(np.int32))
    assert (got[:, want.shape[1]:] == -1).all()


@pytest.mark.parametrize("T,S,topk_blocks,bsize", [(2, 61, CFG.candidate_topk_blocks, CFG.candidate_block_size),
                                                   (1, 600, 20, 8)])
def test_candidate_blocks_then_masked_topk(cuda_ready, T, S, topk_blocks, bsize):
    """Candidate source: block max, pinned newest block, best blocks; a consumer layer then scores inside the
    mask (erratum N1: masked but reachable positions can still fill spare top-k slots)."""
    from kernels.indexer import candidate_blocks, select_topk
    rng = np.random.default_rng(T * S)
    P = np.sort(rng.integers(2 * S - 40, 2 * S, T)).astype(np.int64)
    r = reach(P, 2)
    sc = _tied_scores(rng, T, S, n_levels=12)
    sc = np.where(np.arange(S)[None, :] < r[:, None], sc, -np.inf).astype(np.float32)
    want = ref_candidates(sc, r, topk_blocks, bsize)
    d_sc, d_P = cuda_ready.to_device(sc), cuda_ready.to_device(P)
    keep = candidate_blocks(d_sc, d_P, 2, topk_blocks, bsize, chunk=128).copy_to_host()
    got = np.repeat(keep.astype(bool), bsize, axis=1)[:, :S]
    assert_matches("candidates", got, want)
    masked = np.where(want, sc, -np.inf).astype(np.float32)
    k = CFG.index_topk
    got_idx = select_topk(cuda_ready.to_device(masked), k, positions=d_P, ratio=2, chunk=128).copy_to_host()
    assert_matches("topk", got_idx, ref_topk(masked, r, k).astype(np.int32))
