"""The gguf package is pinned to the release line whose internals ds4lib.formats.gguf relies on; this fails when an
install resolves another line, or when the pin and those internals drift apart."""
import inspect
import re
from importlib.metadata import version
from pathlib import Path

import gguf
from gguf.gguf_writer import GGUFWriter, WriterState

ROOT = Path(__file__).resolve().parents[2]


def test_installed_gguf_is_inside_the_pin():
    spec = re.search(r'"gguf>=([\d.]+),<([\d.]+)"', (ROOT / "pyproject.toml").read_text()).groups()
    lo, hi = (tuple(int(x) for x in v.split(".")) for v in spec)
    have = tuple(int(x) for x in version("gguf").split(".")[:2])
    assert lo <= have < hi, (version("gguf"), spec)
    pinned = re.search(r"^gguf==([\d.]+)$", (ROOT / "constraints.txt").read_text(), re.M).group(1)
    assert lo <= tuple(int(x) for x in pinned.split(".")[:2]) < hi


def test_the_private_internals_we_use_exist():
    assert list(inspect.signature(gguf.GGUFReader._build_tensors).parameters) == ["self", "start_offs", "fields"]
    w = GGUFWriter(path=None, arch="x")
    assert hasattr(w, "fout") and hasattr(w, "state") and WriterState.EMPTY in WriterState


def test_safetensors_is_not_a_dependency():
    text = (ROOT / "pyproject.toml").read_text()
    assert '"safetensors' not in text
    uses = [p for p in (ROOT / "ds4lib").rglob("*.py") if re.search(r"^\s*(import|from) safetensors\b",
                                                                       p.read_text(), re.M)]
    assert not uses, uses
