"""Synthetic device weights (ds4lib.engine.cuda_synth, kernels.synth_fill) against what upload_base makes of a real
base file: the same structure, valid contents, deterministic for a seed. Runs under the CUDA simulator in CI (micro
model) and on a GPU with DS4_REQUIRE_CUDA=1."""
import numpy as np
import pytest

from ds4lib.config import ModelConfig
from ds4lib.formats.floats import bf16_bits_to_f32
from ds4lib.formats.fp8 import E4M3_VALUES
from ds4lib.formats.q4k import dequantize_q4k, dequantize_q8_0
from ds4lib.formats.vq import decode_codebook
from tests.engine.test_engine_cuda import micro_config


def _describe(v):
    """(type, Lin kind, rows, k, shape, dtype) of a CudaWeights entry."""
    from ds4lib.engine.cuda_weights import Lin
    if isinstance(v, Lin):
        return ("Lin", v.kind, v.rows, v.k, tuple(v.w.shape), np.dtype(v.w.dtype))
    if isinstance(v, tuple):
        return ("tuple",) + tuple(_describe(x) for x in v)
    if v is None or isinstance(v, int):
        return (type(v).__name__, v)
    return ("array", tuple(v.shape), np.dtype(v.dtype))


def _values(v):
    """float32 values of a Lin or a float32 array (host)."""
    from ds4lib.engine.cuda_weights import Lin
    if not isinstance(v, Lin):
        return v.copy_to_host()
    raw = v.w.copy_to_host()
    return {"q4_K": dequantize_q4k, "q8_0": dequantize_q8_0, "bf16": bf16_bits_to_f32,
            "f32": np.asarray}[v.kind](raw)


@pytest.fixture(scope="module")
def micro_base(tmp_path_factory):
    """(cfg, the ① base of a quantised random micro checkpoint: layer 0 13-bit, layer 1 12-bit)."""
    from ds4lib.formats.gguf import BaseFile
    from ds4lib.quant.base_file import quantize_checkpoint
    from ds4lib.synth import write_random_checkpoint
    root = tmp_path_factory.mktemp("micro_synth")
    cfg = micro_config()
    ckpt = write_random_checkpoint(root / "ckpt", cfg, seed=0)
    quantize_checkpoint(checkpoint=ckpt, out=root / "base.gguf", bits_plan="1", rounds=1, progress=False)
    base = BaseFile.open(root / "base.gguf")
    assert base.bits[:2] == (13, 12)
    return cfg, base


@pytest.fixture(scope="module")
def micro_pair(micro_base):
    """(cfg, upload_base of the micro base, synthetic_weights of the same config and bits)."""
    from ds4lib.engine.cuda_synth import synthetic_weights
    from ds4lib.engine.cuda_weights import upload_base
    cfg, base = micro_base
    return cfg, upload_base(cfg, base, {}, {}), synthetic_weights(cfg, base.bits, seed=0)


@pytest.mark.slow
def test_upload_refuses_a_codebook_with_nan_codes(micro_base, monkeypatch):
    """A NaN E4M3 code in a layer's codebook is refused at upload with the layer named (padded positions of the
    device layout multiply codeword 0 by zero, and NaN * 0 would poison every output)."""
    import dataclasses

    from ds4lib.engine.cuda_weights import upload_base
    cfg, base = micro_base
    real = base.vq_layer

    def bad(layer):
        vq = real(layer)
        if layer != 1:
            return vq
        codes = vq.codebook_codes.view(np.uint8).copy()
        codes[5, 2] = 0x7F
        return dataclasses.replace(vq, codebook_codes=codes)
    monkeypatch.setattr(base, "vq_layer", bad)
    with pytest.raises(ValueError, match="layer 1: .*NaN"):
        upload_base(cfg, base, {}, {})


@pytest.mark.slow
def test_micro_structure_equals_upload_base(micro_pair):
    cfg, real, synth = micro_pair
    assert list(synth.g) == list(real.g)
    for key in real.g:
        assert _describe(synth.g[key]) == _describe(real.g[key]), key
    assert len(synth.L) == len(real.L) == cfg.n_layers
    for l, (ws, wr) in enumerate(zip(synth.L, real.L)):
        assert list(ws) == list(wr), l
        for key in wr:
            assert _describe(ws[key]) == _describe(wr[key]), (l, key)
    assert synth.nbytes == real.nbytes


def test_shared_gate_up_are_one_linear_of_both_rows(micro_base, micro_pair):
    """upload_base joins the shared expert's w1 and w3 into one linear (w1's rows, then w3's), byte for byte, and
    drops the originals; synthetic weights do the same (the structure test above)."""
    from ds4lib.engine.cuda_weights import SHARED_W13, join_shared_gate_up
    from ds4lib.formats.names import layer_prefix
    cfg, base = micro_base
    _, real, _ = micro_pair
    for l, w in enumerate(real.L):
        p = layer_prefix(cfg, l) + "ffn.shared_experts."
        a, b = base.raw(p + "w1.weight"), base.raw(p + "w3.weight")
        lin = w[SHARED_W13]
        assert (lin.rows, lin.k) == (a.shape[0] + b.shape[0], base.layout[p + "w1.weight"].shape[-1])
        assert np.array_equal(lin.w.copy_to_host(), np.concatenate([a.view(np.uint8), b.view(np.uint8)]))
        assert "ffn.shared_experts.w1.weight" not in w and "ffn.shared_experts.w3.weight" not in w
    odd = {"ffn.shared_experts.w1.weight": real.L[0][SHARED_W13], "ffn.shared_experts.w3.weight": None}
    assert join_shared_gate_up(dict(odd)) == odd                # not two linears of one kind and shape: kept


@pytest.mark.slow
def test_micro_contents_are_finite_and_valid(micro_pair):
    from ds4lib.engine.cuda_weights import Lin
    cfg, _, synth = micro_pair
    entries = [(-1, k, v) for k, v in synth.g.items()] + [(l, k, v) for l, w in enumerate(synth.L) for k, v in w.items()]
    for l, key, v in entries:
        if key.startswith("vq_") or not (isinstance(v, Lin) or v.dtype == np.float32):
            continue
        x = _values(v)
        assert np.isfinite(x).all() and np.abs(x).max() < 8, (l, key)
        if isinstance(v, Lin):                       # projections: deviation ~ fan_in^-1/2 (the embedding: 1)
            want = 1.0 if key == "embed" else v.k ** -0.5
            assert 0.7 * want < x.std() < 1.3 * want, (l, key, x.std(), want)
    for w in synth.L:
        cb = decode_codebook(w["vq_cb"].copy_to_host().view(np.uint8).reshape(-1, 8))   # [C, 8] codewords
        assert cb.shape == (w["vq_cb"].shape[0], 8) and np.isfinite(cb).all() and np.abs(cb).max() < 2
        for g in w["vq_gains"]:
            gv = g.copy_to_host().view(np.float16).astype(np.float32)
            assert np.isfinite(gv).all() and gv.min() > 0
        assert w["vq_scale"] is None and w["vq_experts"] == cfg.n_routed_experts


@pytest.mark.slow
def test_micro_synthetic_weights_are_deterministic(micro_pair):
    """Tensor i of the plan is synth_fill(key=synth_key(seed, i)) and nothing else."""
    from numba import cuda

    from ds4lib.engine.cuda_synth import synthetic_plan
    from kernels.synth_fill import synth_fill, synth_key
    cfg, real, synth = micro_pair
    plan = synthetic_plan(cfg, (13, 12))
    for i, t in enumerate(plan):
        if t.key in ("embed", "attn.wq_b.weight", "vq_index", "vq_plane") and t.layer in (-1, 0):
            v = synth.g[t.key] if t.layer < 0 else synth.L[t.layer][t.key]
            got = (v.w if hasattr(v, "w") else v).copy_to_host()
            for seed, same in ((0, True), (1, False)):
                d = cuda.device_array(t.shape, t.dtype)
                again = synth_fill(d, t.fmt, key=synth_key(seed, i), center=t.center, sigma=t.sigma, k=t.k)
                assert np.array_equal(again.copy_to_host(), got) == same, (t.key, seed)


def test_fills_decode_to_the_planned_laws():
    """q4_K (not in the micro model: its rows are too short) and Q8_0 decode finite with the asked deviation and ~0
    mean; E4M3 codes are never NaN; f16 gains are positive and within a factor 2 of the centre; same key, same
    bytes."""
    from numba import cuda

    from kernels.synth_fill import E4M3_SMALL_RMS, synth_fill, synth_key
    key = synth_key(3, 7)
    for fmt, shape, k in (("q4_K", (6, 2 * 144), 512), ("q8_0", (6, 16 * 34), 512)):
        a = synth_fill(cuda.device_array(shape, np.uint8), fmt, key=key, sigma=0.05, k=k).copy_to_host()
        x = (dequantize_q4k if fmt == "q4_K" else dequantize_q8_0)(a)
        assert x.shape == (6, 512) and np.isfinite(x).all()
        assert 0.04 < x.std() < 0.06 and abs(x.mean()) < 0.01, (fmt, x.std(), x.mean())
        b = synth_fill(cuda.device_array(shape, np.uint8), fmt, key=key, sigma=0.05, k=k).copy_to_host()
        assert np.array_equal(a, b)
    codes = synth_fill(cuda.device_array((512, 8), np.uint8), "e4m3", key=key).copy_to_host()
    assert not ((codes & 0x7F) == 0x7F).any() and len(np.unique(codes)) > 100
    v = E4M3_VALUES[codes]
    assert np.abs(v).max() < 2 and 0.7 < np.sqrt((v.astype(np.float64) ** 2).mean()) / E4M3_SMALL_RMS < 1.3
    g = synth_fill(cuda.device_array((4, 64), np.uint16), "f16", key=key, center=0.03).copy_to_host()
    gv = g.view(np.float16).astype(np.float32)
    assert np.isfinite(gv).all() and gv.min() >= 0.01 and gv.max() < 0.05
    u = synth_fill(cuda.device_array((3000,), np.float32), "f32", key=key, center=1.0, sigma=0.1).copy_to_host()
    assert abs(u.mean() - 1) < 0.01 and 0.09 < u.std() < 0.11 and np.abs(u - 1).max() <= 0.1 * 3 ** 0.5 + 1e-6


def test_v41_plan_covers_the_base_file_at_real_size():
    """Host only: every backbone and global tensor of the V4.1 base file is planned (scales folded, DSpark stages
    and statistics not uploaded), the weights total ~110 GB and every fill indexes fewer than 2^32 words."""
    from ds4lib.engine.cuda_synth import synthetic_plan
    from ds4lib.formats.gguf import base_file_layout
    from ds4lib.quant.plan import parse_bits_plan
    cfg = ModelConfig.v41_flash()
    bits = parse_bits_plan("auto", cfg).bits
    plan = synthetic_plan(cfg, bits)
    names = {t.name for t in base_file_layout(cfg, bits)
             if -1 <= t.layer < cfg.n_layers and not t.name.endswith(".scale") and t.kind != "stats"}
    assert len(plan) == len(names) == 1138
    assert sum(1 for t in plan if t.key == "vq_plane") == 14
    assert 110.0e9 < sum(t.nbytes for t in plan) < 110.5e9
    assert max(t.nbytes for t in plan) // 4 < 1 << 32


def test_engram_tables_are_read_modulo_their_rows():
    from ds4lib.engine.cuda_synth import SyntheticEngramTables, synthetic_token_map
    cfg = micro_config()
    tables = SyntheticEngramTables(cfg, rows=16, seed=0)
    name = "layers.1.engram.embed.weight"
    t = tables.raw(name)
    real = cfg.engram_num_embeddings[0]
    assert t.shape == (real, cfg.engram_head_dim) and tables.has(name[:-len("weight")] + "scale")
    rows = np.array([0, 15, 16, real - 1])
    np.testing.assert_array_equal(t[rows], t.data[rows % 16])
    assert not ((t.data & 0x7F) == 0x7F).any()
    assert tables.raw(name[:-len("weight")] + "scale")[rows].shape == (4, cfg.engram_head_dim // 32)
    with pytest.raises(IndexError):
        t[np.array([real])]
    tmap = synthetic_token_map(cfg)
    assert tmap.shape == (cfg.vocab_size,) and tmap.dtype == np.int64
    assert 0 <= tmap.min() and tmap.max() < cfg.engram_compressed_vocab_size
