"""Official-format checkpoint I/O: lazy reading, byte-exact round trips, refusal of malformed directories."""
import json
import shutil
import struct

import numpy as np
import pytest

from ds4lib.config import ModelConfig
from ds4lib.formats.checkpoint import INDEX_FILE, CheckpointError, CheckpointReader, CheckpointWriter
from ds4lib.formats.safetensors import SafetensorsError, SafetensorsFile, write_safetensors
from ds4lib.synth import write_random_checkpoint


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory):
    return write_random_checkpoint(tmp_path_factory.mktemp("tiny") / "ckpt", ModelConfig.tiny(), seed=3)


def test_official_checkpoint_opens_and_matches_inventory(official_dir):
    r = CheckpointReader.open(official_dir / "checkpoint")
    assert len(r.inventory) == 1962
    w = r.weight("layers.0.ffn.experts.5.w2.weight")
    assert w.shape == (256, 128) and w.dtype == np.float32
    arr = r.raw("embed.weight")
    assert not arr.flags.writeable and not arr.flags.owndata      # a view into the memory map


def test_round_trip_is_byte_exact(tiny_ckpt, tmp_path):
    r = CheckpointReader.open(tiny_ckpt)
    w = CheckpointWriter(tmp_path / "copy", r.cfg, shard_bytes=512 << 20, metadata={"generator": "ds4 tiny --seed 3"})
    for name in r.inventory:
        w.add(name, np.array(r.raw(name)))
    w.close({"engram_token_map.json": (tiny_ckpt / "engram_token_map.json").read_text()})
    for f in sorted(p.name for p in tiny_ckpt.iterdir()):
        assert (tmp_path / "copy" / f).read_bytes() == (tiny_ckpt / f).read_bytes(), f


def test_seeded_generation_is_deterministic(tiny_ckpt, tmp_path):
    again = write_random_checkpoint(tmp_path / "again", ModelConfig.tiny(), seed=3)
    assert CheckpointReader.open(again).content_hash() == CheckpointReader.open(tiny_ckpt).content_hash()
    other = write_random_checkpoint(tmp_path / "other", ModelConfig.tiny(), seed=4)
    assert CheckpointReader.open(other).content_hash() != CheckpointReader.open(tiny_ckpt).content_hash()


def _rewrite_shard(ckpt, drop=(), add=(), reshape=None):
    shard = next(ckpt.glob("*.safetensors"))
    f = SafetensorsFile(shard)
    tensors = []
    for n in f.keys():
        if n in drop:
            continue
        a = np.array(f.array(n))
        if reshape and n == reshape:
            a = a[:-1]
        tensors.append((n, f.dtype(n), a))
    tensors += list(add)
    f.close()
    write_safetensors(shard, tensors)
    idx = json.loads((ckpt / INDEX_FILE).read_text())
    idx["weight_map"] = {n: shard.name for n, _, _ in tensors}
    (ckpt / INDEX_FILE).write_text(json.dumps(idx))


@pytest.mark.parametrize("damage, message", [
    (dict(drop=("layers.3.attn.wq_a.weight",)), "missing tensors: layers.3.attn.wq_a.weight"),
    (dict(add=(("layers.3.attn.bogus", "F32", np.zeros(3, np.float32)),)), "unexpected tensors: layers.3.attn.bogus"),
    (dict(reshape="layers.2.attn.attn_sink"), "mis-shaped tensors: layers.2.attn.attn_sink"),
])
def test_malformed_checkpoint_is_refused(tiny_ckpt, tmp_path, damage, message):
    bad = tmp_path / "bad"
    shutil.copytree(tiny_ckpt, bad)
    _rewrite_shard(bad, **damage)
    with pytest.raises(CheckpointError, match=message.replace(".", r"\.")):
        CheckpointReader.open(bad)


def test_truncated_and_garbage_files_are_refused(tiny_ckpt, tmp_path):
    bad = tmp_path / "trunc"
    shutil.copytree(tiny_ckpt, bad)
    shard = next(bad.glob("*.safetensors"))
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) - 1000])
    with pytest.raises(CheckpointError, match="truncated"):
        CheckpointReader.open(bad)
    shard.write_bytes(struct.pack("<Q", 10 ** 9) + b"{}")
    with pytest.raises(CheckpointError, match="truncated or corrupt header"):
        CheckpointReader.open(bad)
    shard.write_bytes(struct.pack("<Q", 4) + b"nope")
    with pytest.raises(CheckpointError, match="not JSON"):
        CheckpointReader.open(bad)


def test_bad_config_is_refused(tiny_ckpt, tmp_path):
    bad = tmp_path / "cfg"
    shutil.copytree(tiny_ckpt, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["text_config"]["o_groups"] = 3
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="n_heads=8 must be divisible by o_groups=3"):
        CheckpointReader.open(bad)


def test_writer_refuses_wrong_order_shape_and_incomplete(tmp_path):
    cfg = ModelConfig.tiny()
    w = CheckpointWriter(tmp_path / "w", cfg)
    with pytest.raises(CheckpointError, match="out of order"):
        w.add("head.weight", np.zeros((1024, 256), np.uint16))
    with pytest.raises(CheckpointError, match="has shape"):
        w.add("embed.weight", np.zeros((3, 3), np.uint16))
    with pytest.raises(CheckpointError, match="incomplete"):
        w.close()


def test_safetensors_writer_is_atomic_and_deterministic(tmp_path):
    a = [("x", "F32", np.arange(6, dtype=np.float32).reshape(2, 3)), ("y", "BF16", np.ones(4, np.uint16))]
    write_safetensors(tmp_path / "a.safetensors", a, {"k": "v"})
    write_safetensors(tmp_path / "b.safetensors", a, {"k": "v"})
    assert (tmp_path / "a.safetensors").read_bytes() == (tmp_path / "b.safetensors").read_bytes()
    f = SafetensorsFile(tmp_path / "a.safetensors")
    np.testing.assert_array_equal(f.array("x"), a[0][2])
    assert f.metadata == {"k": "v"} and not list(tmp_path.glob("*.partial"))
    with pytest.raises(SafetensorsError, match="unsupported dtype"):
        head = b'{"x":{"dtype":"Q9","shape":[1],"data_offsets":[0,1]}}'
        (tmp_path / "c.safetensors").write_bytes(struct.pack("<Q", len(head)) + head + b"\0")
        SafetensorsFile(tmp_path / "c.safetensors")
