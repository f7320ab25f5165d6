"""The ② directory format's fixes (issue 11 item 8): NaN scale bytes refused, fingerprint over the listed files
only and fast, rewriting never loses the previous copy; the per-layer writers the solver uses."""
import os
import time

import numpy as np
import pytest

from ds4lib.config import ModelConfig
from ds4lib.formats import sidecar as S


@pytest.fixture
def cfg():
    return ModelConfig.tiny()


def _write(root, cfg, seed=0):
    rng = np.random.default_rng(seed)
    E = cfg.moe_shape(2)[0]
    return S.write_sidecar(root, cfg, kind="sidecar", gain_deltas={2: rng.normal(0, .1, (E, cfg.dim)),
                                                                    5: rng.normal(0, .1, (E, cfg.dim))},
                           bias={2: rng.normal(0, .1, E)})


def test_scale_byte_255_is_refused(tmp_path, cfg):
    root = _write(tmp_path / "sc", cfg)
    raw = bytearray((root / "gr_L05.bin").read_bytes())
    raw[3 * S.BLOCK_BYTES] = 255
    (root / "gr_L05.bin").write_bytes(bytes(raw))
    with pytest.raises(S.SidecarError, match="scale byte 255"):
        S.read_sidecar(root, cfg)


def test_fingerprint_covers_listed_files_only(tmp_path, cfg):
    root = _write(tmp_path / "sc", cfg)
    fp = S.directory_fingerprint(root)
    (root / "gr_L07.bin").write_bytes(b"stray")          # not in the manifest
    (root / "notes.txt").write_text("hello")
    assert S.directory_fingerprint(root) == fp
    raw = bytearray((root / "rb_L02.bin").read_bytes())
    raw[0] ^= 1
    (root / "rb_L02.bin").write_bytes(bytes(raw))
    assert S.directory_fingerprint(root) != fp
    assert S.listed_files(S.read_sidecar(root, cfg).manifest) == ["gr_L02.bin", "rb_L02.bin", "gr_L05.bin"]


def test_fingerprint_definition_and_speed(tmp_path, cfg):
    data = np.random.default_rng(0).integers(0, 256, 5000, dtype=np.uint8).tobytes()
    assert S.fnv1a64(data) == S._fnv1a64_py(data, S.FNV_OFFSET)          # compiled loop == the definition
    assert S.fnv1a64(b"a") == 0xAF63DC4C8601EC8C                            # published FNV-1a 64 test vector
    big = np.random.default_rng(1).integers(0, 256, 40 << 20, dtype=np.uint8).tobytes()
    S.fnv1a64(big[:8192])                                                   # compile once
    t0 = time.perf_counter()
    S.fnv1a64(big)
    assert time.perf_counter() - t0 < 0.5


def test_rewrite_keeps_previous_copy_even_when_interrupted(tmp_path, cfg, monkeypatch):
    root = tmp_path / "sc"
    _write(root, cfg, seed=0)
    fp0 = S.directory_fingerprint(root)
    _write(root, cfg, seed=1)
    fp1 = S.directory_fingerprint(root)
    assert S.directory_fingerprint(tmp_path / "sc.old") == fp0
    real = os.replace

    def failing(src, dst):
        if str(src).endswith(".partial"):
            raise OSError("disk full")
        return real(src, dst)
    monkeypatch.setattr(S.os, "replace", failing)
    with pytest.raises(OSError):
        _write(root, cfg, seed=2)
    monkeypatch.undo()
    found = {S.directory_fingerprint(p) for p in tmp_path.iterdir() if (p / "manifest.json").exists()}
    assert fp1 in found and fp0 in found


def test_layer_writer_and_manifest(tmp_path, cfg):
    root = tmp_path / "sc"
    root.mkdir()
    E = cfg.moe_shape(1)[0]
    blocks = S.quantize_gains(np.full((E, cfg.dim), 0.25, np.float32))
    S.write_layer_files(root, cfg, 1, gain_blocks=blocks, bias=np.ones(E))
    S.write_manifest(root, cfg, kind="sidecar", layers={1: {"gains": True, "bias": False, "done": True}})
    sc = S.read_sidecar(root, cfg)
    np.testing.assert_array_equal(sc.gains[1], np.full((E, cfg.dim), 1.25, np.float32))
    assert 1 not in sc.bias                                   # written but not listed: not part of the sidecar
    with pytest.raises(S.SidecarError, match="finite"):
        S.write_layer_files(root, cfg, 1, bias=np.full(E, np.nan))
