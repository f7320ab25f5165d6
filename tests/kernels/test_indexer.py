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


def _index_case(cfg, rng, T, S, P, ratio, bsize, cand_p=0.7, cancel=False):
    """(the reference's scores with a candidate mask applied, the kernel's inputs) for queries at positions P over S
    FP4-simulated keys, candidates on blocks of `bsize` rows kept with probability cand_p. `cancel`: the last head
    repeats the first one's query with its weight negated, both weights 2^16 larger than the others, so the first
    and last terms cancel exactly and the rounding of the terms in between shows the order of the head sum."""
    ni, di = cfg.index_n_heads, cfg.index_head_dim
    freqs = rope_freqs(cfg.rope_head_dim, cfg.compress_rope_theta, True, cfg.original_seq_len, cfg.rope_factor,
                       cfg.beta_fast, cfg.beta_slow)
    w = {"attn.indexer.wq_b.weight": round_bf16(rng.standard_normal((ni * di, cfg.q_lora_rank)) * 0.1),
         "attn.indexer.weights_proj.weight": round_bf16(rng.standard_normal((ni, cfg.dim)) * 0.1)}
    if cancel:
        w["attn.indexer.wq_b.weight"][(ni - 1) * di:] = w["attn.indexer.wq_b.weight"][:di]
        w["attn.indexer.weights_proj.weight"][0] *= np.float32(2.0 ** 16)
        w["attn.indexer.weights_proj.weight"][ni - 1] = -w["attn.indexer.weights_proj.weight"][0]
    x = round_bf16(rng.standard_normal((T, cfg.dim)))
    qr = round_bf16(rng.standard_normal((T, cfg.q_lora_rank)))
    P = np.asarray(P, dtype=np.int64)
    keys = act_quant_fp4_pow2(round_bf16(rng.standard_normal((S, di))), 32)
    cand = (rng.random((T, -(-S // bsize))) < cand_p).astype(np.uint8)
    want = ref_scores(x, qr, w, cfg, keys, P, ratio, freqs, True)
    want = np.where(np.repeat(cand.astype(bool), bsize, axis=1)[:, :S], want, -np.inf)
    # the kernel's inputs, from the reference's own steps
    q = act_quant_fp4_pow2(apply_rope(linear_q(qr, w["attn.indexer.wq_b.weight"], True).reshape(T, ni, di), P,
                                      freqs), 32)
    wts = linear_bf16(x, w["attn.indexer.weights_proj.weight"])
    return want.astype(np.float32), (q, wts, di ** -0.5 * ni ** -0.5, f32_to_bf16_bits(keys), P, ratio, cand, bsize)


def _run_index_scores(cuda, args, tensor_cores):
    from kernels.indexer import index_scores
    q, wts, wscale, keys, P, ratio, cand, bsize = args
    return index_scores(cuda.to_device(q), cuda.to_device(wts), wscale, cuda.to_device(keys), cuda.to_device(P),
                        ratio, cand=cuda.to_device(cand), cand_block=bsize, tensor_cores=tensor_cores).copy_to_host()


@pytest.mark.parametrize("tensor_cores", [True, False])
def test_index_scores_bit_exact(cuda_ready, tensor_cores):
    """A query at position 597 (ratio 2: reach 299 of 300 rows, 2 blocks), FP4-simulated as in the model, with a
    candidate mask on blocks of 4 positions (a consumer layer)."""
    want, args = _index_case(CFG, np.random.default_rng(1), 1, 300, [597], 2, 4)
    got = _run_index_scores(cuda_ready, args, tensor_cores)
    assert_matches("index_scores", got, want)
    assert np.isfinite(got).sum() > 100 and np.isneginf(got[0, 299])


@pytest.mark.parametrize("tensor_cores", [True, False])
def test_index_scores_bit_exact_v41_heads(cuda_ready, tensor_cores):
    """V4.1's indexer shape (32 heads of 128 dims: every head tile and dim step of the tensor-core kernel), two
    queries: one whose reach (150 of 200 rows at ratio 4) ends inside a 16-row tile and leaves later tiles wholly
    out of reach, one that reaches every row; candidates on blocks of 8. The first and last heads cancel (`cancel`),
    so only the 32 terms added in head order give the reference's bits (reversed, many rows differ)."""
    cfg = ModelConfig.v41_flash()
    want, args = _index_case(cfg, np.random.default_rng(2), 2, 200, [599, 100000], 4, cfg.candidate_block_size,
                             cancel=True)
    got = _run_index_scores(cuda_ready, args, tensor_cores)
    assert_matches("index_scores", got, want)
    assert np.isneginf(got[0, 150:]).all() and np.isfinite(got[0, :150]).sum() > 80
    assert np.isfinite(got[1]).sum() > 100


def _tied_scores(rng, T, S, n_levels=6):
    """BF16 scores with many exact ties, -0.0 and +0.0, and -inf (masked) entries."""
    levels = round_bf16(np.concatenate([rng.standard_normal(n_levels - 2), [0.0, -0.0]]))
    sc = levels[rng.integers(0, n_levels, (T, S))].astype(np.float32)
    sc[rng.random((T, S)) < 0.2] = -np.inf
    return sc


@pytest.mark.parametrize("one_block", [True, False])                # one launch a call, or selection blocks
@pytest.mark.parametrize("T,S,k,chunk", [(1, 700, 64, 128),      # 6 selection blocks, ties across blocks
                                         (3, 40, 8, 4096),       # decode-size row, k < reach
                                         (2, 5, 8, 128)])        # fewer rows than k: -1 padding
def test_select_topk_matches_ref(cuda_ready, T, S, k, chunk, one_block):
    from kernels.indexer import select_topk
    rng = np.random.default_rng(S)
    sc = _tied_scores(rng, T, S)
    P = rng.integers(0, 2 * S + 2, T).astype(np.int64)
    P[0] = 2 * S + 1                                              # one query sees every row
    P[-1] = 0 if T > 2 else P[-1]                                 # and one sees none: all -1
    want = ref_topk(sc, reach(P, 2), k)                          # width min(k, S)
    got = select_topk(cuda_ready.to_device(sc), k, positions=cuda_ready.to_device(P), ratio=2,
                      chunk=chunk, one_block=one_block).copy_to_host()
    assert_matches("topk", got[:, :want.shape[1]], want.astype(np.int32))
    assert (got[:, want.shape[1]:] == -1).all()


@pytest.mark.parametrize("one_block", [True, False])
@pytest.mark.parametrize("T,S,topk_blocks,bsize", [(2, 61, CFG.candidate_topk_blocks, CFG.candidate_block_size),
                                                   (1, 600, 20, 8)])
def test_candidate_blocks_then_masked_topk(cuda_ready, T, S, topk_blocks, bsize, one_block):
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
    keep = candidate_blocks(d_sc, d_P, 2, topk_blocks, bsize, chunk=128, one_block=one_block).copy_to_host()
    got = np.repeat(keep.astype(bool), bsize, axis=1)[:, :S]
    assert_matches("candidates", got, want)
    masked = np.where(want, sc, -np.inf).astype(np.float32)
    k = CFG.index_topk
    got_idx = select_topk(cuda_ready.to_device(masked), k, positions=d_P, ratio=2, chunk=128,
                          one_block=one_block).copy_to_host()
    assert_matches("topk", got_idx, ref_topk(masked, r, k).astype(np.int32))


def test_sm90_topk_one_kernel_fits_its_block():
    """ptxas for sm_90 with the kernel's launch bounds: a block of ONE_THREADS (1,024 on the GPU) fits the SM's
    65,536 registers (a thread's count rounded up to 8) without spills."""
    from tests.kernels.compile_sm90 import ptx_texts, ptxas_path, ptxas_resources
    if ptxas_path() is None:
        pytest.skip("no ptxas (CUDA toolkit) on this machine")
    ptx = ptx_texts(["indexer:topk_one_kernel"])["indexer:topk_one_kernel"]
    assert ".maxntid 1024, 1, 1" in ptx
    r = ptxas_resources(ptx)
    assert -(-r["registers"] // 8) * 8 * 1024 <= 65536 and r["spill_bytes"] == 0, r
