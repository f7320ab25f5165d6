"""`ds4 quantize`: deterministic bytes, the error it reports is the engine's, and the measurements run."""
import numpy as np

from ds4lib.formats.checkpoint import CheckpointReader
from ds4lib.formats.gguf import BaseFile
from ds4lib.formats.vq import EXPERT_MATRICES
from ds4lib.quant import bitwidth_curve, file_errors, file_sha256, shared_vs_per_expert
from ds4lib.quant.vq_layer import expert_weight
from ds4lib.solvers.vq import matrix_error
from ds4lib.tools.cli import main


def test_cli_twice_gives_identical_bytes_and_prints_the_size_table(micro_checkpoint, tmp_path, capsys):
    args = ["quantize", "--checkpoint", str(micro_checkpoint), "--rounds", "2", "--bits-plan", "2", "--quiet"]
    assert main(args + ["--out", str(tmp_path / "a.gguf")]) == 0
    out = capsys.readouterr().out
    assert main(args + ["--out", str(tmp_path / "b.gguf")]) == 0
    assert file_sha256(tmp_path / "a.gguf") == file_sha256(tmp_path / "b.gguf")
    assert "Routed-expert indices" in out and "6 layers x 12 bit + 2 layers x 13 bit" in out
    assert f"sha256 {file_sha256(tmp_path / 'a.gguf')}" in out
    assert BaseFile.open(tmp_path / "a.gguf").bits == (13, 13) + (12,) * 8


def test_cli_refuses_bad_input(tmp_path, capsys):
    assert main(["quantize", "--checkpoint", str(tmp_path / "none"), "--out", str(tmp_path / "x.gguf")]) == 2
    assert "does not exist" in capsys.readouterr().out


def test_reported_error_is_the_engine_error(micro_checkpoint, tmp_path):
    from ds4lib.quant import quantize_checkpoint
    rep = quantize_checkpoint(checkpoint=micro_checkpoint, out=tmp_path / "q.gguf", rounds=2, progress=False)
    bf = BaseFile.open(tmp_path / "q.gguf")
    reader = CheckpointReader.open(micro_checkpoint)
    assert np.array_equal(bf.stats, rep.stats)
    for layer in (0, 5, bf.config.n_layers):                # 13-bit, 12-bit, DSpark
        want = np.zeros((3, 2))
        mine = np.zeros((3, 2))
        for e in range(bf.config.moe_shape(layer)[0]):
            for mi, m in enumerate(EXPERT_MATRICES):
                w = expert_weight(reader, layer, e, m)
                what = bf.dequant_expert(layer, e, m)        # what the engine computes, from the file alone
                d = w.astype(np.float64) - what
                want[mi] += ((d * d).sum(), (w.astype(np.float64) ** 2).sum())
                # the quantizer's own error routine on the file's indices gives the reported numbers exactly
                mine[mi] += matrix_error(w, bf.codebook(layer), bf.gains(layer, m)[e],
                                         bf.expert_indices(layer, e, m))
        assert np.array_equal(bf.stats[layer], mine)        # bit for bit: same values, same order
        np.testing.assert_allclose(bf.stats[layer], want, rtol=1e-12)   # NumPy's own sums, another order
    errs = file_errors(base=tmp_path / "q.gguf", checkpoint=micro_checkpoint)
    assert errs["max_abs_diff"] < 1e-12
    assert all(r["rel_error"] < 0.1 for r in errs["linears"])
    rows = rep.layer_rows()
    assert rows[0]["bits"] == 13 and rows[-1]["kind"] == "dspark 1" and all(0.2 < r["all"] < 0.6 for r in rows)


def test_measurements(micro_checkpoint):
    curve = bitwidth_curve(checkpoint=micro_checkpoint, layers=[1], bits=(8, 10), rounds=2)
    assert [r["bits"] for r in curve] == [8, 10] and curve[1]["all"] < curve[0]["all"]
    cmp = shared_vs_per_expert(checkpoint=micro_checkpoint, layers=[1], bits=8, rounds=2)
    assert [r["scheme"] for r in cmp] == ["shared per layer", "one per expert"]
    assert cmp[1]["codebooks"] == 4 and cmp[1]["bits_per_weight"] > cmp[0]["bits_per_weight"]


def test_same_checkpoint_in_two_folders_gives_identical_bytes_and_no_path(micro_checkpoint, tmp_path):
    import shutil
    from ds4lib.formats import names as N
    from ds4lib.quant import quantize_checkpoint
    a = shutil.copytree(micro_checkpoint, tmp_path / "one" / "ck")
    b = shutil.copytree(micro_checkpoint, tmp_path / "two" / "deeper" / "other-name")
    quantize_checkpoint(checkpoint=a, out=tmp_path / "a.gguf", rounds=1, bits_plan="2", progress=False)
    quantize_checkpoint(checkpoint=b, out=tmp_path / "b.gguf", rounds=1, bits_plan="2", progress=False)
    raw = (tmp_path / "a.gguf").read_bytes()
    assert raw == (tmp_path / "b.gguf").read_bytes()
    assert str(tmp_path).encode() not in raw and b"/ck" not in raw
    base = BaseFile.open(tmp_path / "a.gguf")
    assert N.KEY_SOURCE_DIR not in base.metadata
    assert base.source_hash == CheckpointReader.open(micro_checkpoint).content_hash()
