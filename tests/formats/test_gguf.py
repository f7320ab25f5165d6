"""The ds4 base GGUF: layout, metadata, zero-copy reader, and refusal of bad files with a clear message."""
import json
import os
import shutil

import numpy as np
import pytest
from gguf import GGUFReader

from ds4lib.config import ModelConfig
from ds4lib.formats import names as N
from ds4lib.formats.checkpoint import CheckpointReader
from ds4lib.formats.gguf import BaseFile, BaseFileError, GGUFStreamWriter, base_file_layout
from ds4lib.formats.q4k import dequantize_q4k
from ds4lib.formats.vq import decode_codebook, dequant_matrix, unpack_indices
from ds4lib.synth import write_random_checkpoint


def micro_config():
    return ModelConfig.tiny().replace(n_routed_experts=4, n_activated_experts=2, moe_inter_dim=64,
                                      dspark_n_routed_experts=2, dspark_n_activated_experts=1)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    from ds4lib.quant import quantize_checkpoint
    d = tmp_path_factory.mktemp("gguf")
    ck = write_random_checkpoint(d / "ck", micro_config(), seed=2)
    rep = quantize_checkpoint(checkpoint=ck, out=d / "base.gguf", rounds=1, progress=False)
    return ck, d / "base.gguf", rep


def test_layout_metadata_and_alignment(base):
    ck, path, rep = base
    bf = BaseFile.open(path)
    reader = CheckpointReader.open(ck)
    cfg = reader.cfg
    assert bf.config == cfg and bf.format_version == 3 and bf.bits == (13, 13, 13) + (12,) * 7
    md = bf.metadata
    assert md[N.KEY_VQ_MAGIC] == "DQV3" and md[N.KEY_VQ_DIM] == 8 and md[N.KEY_VQ_BITS_PLAN] == "auto"
    assert md[N.KEY_SOURCE_HASH] == reader.content_hash() == rep.source_hash
    assert json.loads(md[N.KEY_MODEL_CONFIG]) == json.loads(json.dumps(cfg.to_hf_dict()))
    assert bf.size_table["total_bytes"] == os.path.getsize(path) == rep.size_table["total_bytes"]
    g = GGUFReader(path)
    assert all((t.data_offset % 128) == 0 for t in g.tensors)
    names = set(bf.names())
    assert "layers.3.attn.wq_a.weight" in names and "layers.3.attn.wq_a.scale" not in names
    assert "layers.2.attn.indexer.wq_b.scale" in names                  # FP8 kept as stored, with its scale
    assert not any(".engram.embed." in n or ".ffn.experts.0." in n for n in names)
    assert [t.name for t in base_file_layout(cfg, bf.bits)] == [t.name for t in g.tensors]
    bf.close()


def test_reader_views_and_decoding(base):
    ck, path, _ = base
    bf = BaseFile.open(path)
    reader = CheckpointReader.open(ck)
    v = bf.vq_layer(0)
    assert v.bits == 13 and v.plane is not None and bf.vq_layer(3).plane is None
    assert v.index.dtype == np.uint8 and v.index.shape == (4, 3, 8 * 384)       # 2,048 indices = 8 blocks
    assert not v.index.flags.writeable and not v.index.flags.owndata               # a view into the map
    for e in range(4):                                        # every expert payload on a 128-byte line
        stream, plane = bf.packed_indices(0, e, "w1")
        assert stream.ctypes.data % 128 == 0 and stream.size == 8 * 384 and plane.size == 256
    assert v.gains["w2"].dtype == np.float16 and v.gains["w2"].shape == (4, 256)
    w = bf.dequant_expert(0, 1, "w2")
    idx = unpack_indices(v.index[1, 1], 256 * 64 // 8, v.plane[1, 1]).reshape(256, 8)
    assert np.array_equal(idx, bf.expert_indices(0, 1, "w2")) and idx.max() < 8192
    assert np.array_equal(w, dequant_matrix(decode_codebook(v.codebook_codes), v.gains["w2"][1], idx))
    assert np.array_equal(bf.codebook(0), decode_codebook(v.codebook_codes))
    assert np.array_equal(bf.tensor("layers.0.attn.wq_a.weight"), dequantize_q4k(bf.raw("layers.0.attn.wq_a.weight")))
    for name in ("layers.0.attn_norm.weight", "layers.0.hc_attn_fn", "layers.2.attn.indexer.wq_b.weight",
                 "layers.0.ffn.gate.weight"):
        assert np.array_equal(bf.tensor(name), reader.weight(name)), name
    with pytest.raises(BaseFileError, match="no tensor"):
        bf.raw("layers.0.ffn.experts.0.w1.weight")
    bf.close()


def _patched(src, dst, key: bytes, old: bytes, new: bytes):
    data = bytearray(src.read_bytes())
    at = data.index(key) + len(key)
    pos = data.index(old, at)
    assert pos - at < 16
    data[pos:pos + len(old)] = new
    dst.write_bytes(bytes(data))
    return dst


def test_refuses_bad_files_naming_the_problem(base, tmp_path):
    _, path, _ = base
    with pytest.raises(BaseFileError, match="no such file"):
        BaseFile.open(tmp_path / "nope.gguf")
    (tmp_path / "junk.gguf").write_bytes(b"PK\x03\x04" + bytes(100))
    with pytest.raises(BaseFileError, match="not a GGUF file"):
        BaseFile.open(tmp_path / "junk.gguf")
    bad = _patched(path, tmp_path / "v.gguf", N.KEY_FORMAT_VERSION.encode(), (3).to_bytes(4, "little"),
                   (99).to_bytes(4, "little"))
    with pytest.raises(BaseFileError, match=r"unknown ds4 format version 99.*knows \[3\]"):
        BaseFile.open(bad)
    bad = _patched(path, tmp_path / "m.gguf", N.KEY_VQ_MAGIC.encode(), b"DQV3", b"DQV2")
    with pytest.raises(BaseFileError, match="wrong VQ payload magic 'DQV2'"):
        BaseFile.open(bad)
    data = path.read_bytes()
    (tmp_path / "t.gguf").write_bytes(data[:len(data) - 100])
    with pytest.raises(BaseFileError, match=r"truncated: tensor 'ds4.vq.stats' ends at byte \d+ but the file"):
        BaseFile.open(tmp_path / "t.gguf")
    (tmp_path / "t2.gguf").write_bytes(data[:len(data) // 2])       # names the first tensor that is cut
    with pytest.raises(BaseFileError, match=r"truncated: tensor 'layers\.\d+\..*' ends at byte"):
        BaseFile.open(tmp_path / "t2.gguf")
    (tmp_path / "h.gguf").write_bytes(data[:300])
    with pytest.raises(BaseFileError, match="truncated or corrupt GGUF header"):
        BaseFile.open(tmp_path / "h.gguf")


def test_stream_writer_enforces_order_and_completeness(base, tmp_path):
    _, path, _ = base
    bf = BaseFile.open(path)
    layout = list(bf.layout.values())
    w = GGUFStreamWriter(tmp_path / "x.gguf", layout, [(N.KEY_FORMAT_VERSION, 3, 4)])
    with pytest.raises(ValueError, match="out of order"):
        w.write(layout[1].name, np.zeros(layout[1].nbytes, np.uint8))
    w.begin(layout[0].name)
    with pytest.raises(ValueError, match="bytes written"):
        w.write_bytes(np.zeros(layout[0].nbytes + 1, np.uint8))
    with pytest.raises(ValueError, match="incomplete"):
        w.close()
    assert not (tmp_path / "x.gguf").exists() and not (tmp_path / "x.gguf.partial").exists()
    shutil.copy(path, tmp_path / "copy.gguf")
    assert BaseFile.open(tmp_path / "copy.gguf").size_table == bf.size_table
