"""The shipped ① base models/ds4-tiny-base.gguf: built by `ds4 quantize` from models/ds4-tiny, named by sha256
in the model card, identified with its checkpoint by content hash (no path inside), rebuilt byte for byte
(`ds4 quantize --verify`)."""
import re
from pathlib import Path

import pytest

from ds4lib.formats.checkpoint import CheckpointReader
from ds4lib.formats.gguf import BaseFile, data_offsets, file_bytes
from ds4lib.quant import file_sha256
from ds4lib.tools.cli import main

ROOT = Path(__file__).resolve().parents[2]
CHECKPOINT = ROOT / "models" / "ds4-tiny"
SHIPPED = ROOT / "models" / "ds4-tiny-base.gguf"


def _card_sha256() -> str:
    m = re.search(r"ds4-tiny-base\.gguf.*?sha256 `([0-9a-f]{64})`", (CHECKPOINT / "README.md").read_text(), re.S)
    assert m, "models/ds4-tiny/README.md must name the shipped base's sha256 as: sha256 `<64 hex>`"
    return m.group(1)


def test_shipped_base_matches_the_card_and_the_checkpoint():
    assert file_sha256(SHIPPED) == _card_sha256()
    base = BaseFile.open(SHIPPED)
    reader = CheckpointReader.open(CHECKPOINT)
    assert base.source_hash == reader.content_hash()
    assert not any(isinstance(v, str) and str(ROOT) in v for v in base.metadata.values())


def test_engine_finds_the_checkpoint_beside_the_shipped_base():
    from ds4lib.engine import Engine
    engine = Engine(SHIPPED)                      # no --engram-dir: models/ds4-tiny is found by content hash
    assert engine.engram_dir.resolve() == CHECKPOINT.resolve()


def test_shipped_base_rebuilds_to_identical_bytes(capsys):
    """`ds4 quantize --verify`: the shipped base's header, every q4_K / Q8_0 / stored tensor and the routed experts of
    layer 9 (a DSpark stage: Lloyd's 32 rounds for all ten layers take ~10 min on 2 cores, so CI rebuilds one; each
    layer's VQ tensors depend only on that layer's weights) are rebuilt from models/ds4-tiny byte for byte. The
    whole file: `ds4 quantize --checkpoint models/ds4-tiny --verify models/ds4-tiny-base.gguf`."""
    assert main(["quantize", "--checkpoint", str(CHECKPOINT), "--verify", str(SHIPPED), "--layers", "9",
                 "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "header same, size same, 249 of 249 tensors the same (routed experts of layers 9)" in out, out


def test_verify_names_the_tensor_that_differs(tiny_stack, tmp_path, capsys):
    """A base file with one changed byte in a q4_K tensor, or in a routed-expert index stream, fails `--verify`
    with that tensor named; the untouched file passes; a layer number out of range is a clear error."""
    ckpt, base = tiny_stack
    b = BaseFile.open(base)
    layout = list(b.layout.values())                                    # in file order
    b.close()
    q4k = next(t for t in layout if t.kind == "q4_K")
    vq = next(t for t in layout if t.kind == "vq_index" and t.layer == 1)
    raw = Path(base).read_bytes()
    offsets = data_offsets(layout, len(raw) - file_bytes(layout, 0))
    assert main(["quantize", "--checkpoint", str(ckpt), "--verify", str(base), "--layers", "1", "--quiet"]) == 0
    capsys.readouterr()
    for t in (q4k, vq):
        bad = bytearray(raw)
        bad[offsets[t.name][0] + 5] ^= 0x10
        path = tmp_path / f"bad_{t.kind}.gguf"
        path.write_bytes(bytes(bad))
        assert main(["quantize", "--checkpoint", str(ckpt), "--verify", str(path), "--layers", "1", "--quiet"]) == 1
        assert f"differs: {t.name}" in capsys.readouterr().out
    assert main(["quantize", "--checkpoint", str(ckpt), "--verify", str(base), "--layers", "99", "--quiet"]) == 2
    assert "vq_layers must lie in" in capsys.readouterr().out
