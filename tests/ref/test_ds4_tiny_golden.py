"""ds4-tiny (models/ds4-tiny, the trained original) loads with ReferenceModel.load and reproduces the committed
golden logits; the checkpoint bytes are the ones the golden file was made from."""
from pathlib import Path

import numpy as np

from ds4lib.ref import ReferenceModel

ROOT = Path(__file__).resolve().parents[2]


def test_ds4_tiny_reproduces_golden_logits():
    g = np.load(ROOT / "tests" / "golden" / "ds4_tiny_logits.npz")
    m = ReferenceModel.load(ROOT / "models" / "ds4-tiny")
    assert m.reader.content_hash() == str(g["content_hash"])
    lg = m.logits(g["tokens"])
    np.testing.assert_array_equal(lg.argmax(-1), g["logits"].argmax(-1))
    np.testing.assert_allclose(lg, g["logits"], rtol=0, atol=1e-3)
    assert m.cfg.vocab_size == 8192 and m.cfg.n_mtp_layers == 2
