"""The shipped ① base models/ds4-tiny-base.gguf: built by `ds4 quantize` from models/ds4-tiny, named by sha256
in the model card, identified with its checkpoint by content hash (no path inside), rebuilt byte for byte."""
import re
from pathlib import Path

import pytest

from ds4lib.formats.checkpoint import CheckpointReader
from ds4lib.formats.gguf import BaseFile
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


@pytest.mark.slow
def test_shipped_base_rebuilds_to_identical_bytes(tmp_path):
    out = tmp_path / "rebuilt.gguf"
    assert main(["quantize", "--checkpoint", str(CHECKPOINT), "--out", str(out), "--quiet"]) == 0
    assert file_sha256(out) == file_sha256(SHIPPED) == _card_sha256()
