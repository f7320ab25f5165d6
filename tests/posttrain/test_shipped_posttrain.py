"""The ③ post-training file committed beside ds4-tiny (models/posttrain/finance, solved by notebooks/posttrain.ipynb
on day 1 of data/posttrain/general): it reads as a ③ of the shipped ① base, is fingerprinted to the shipped finance
② sidecar, mounts with it through the engine and `ds4 --posttrain`, and is refused on any other sidecar or alone.

Not checked here: re-solving it bit for bit. That needs the whole day's generation, capture and verification again
(3–6 minutes on the 2-core CI box; two such runs, `ds4 posttrain` and the notebook, wrote the same bytes), far over
the one minute a shipped-file test may take."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from ds4lib.chat import encode_chat
from ds4lib.engine import Engine, EngineError
from ds4lib.formats.gguf import BaseFile
from ds4lib.formats.sidecar import directory_fingerprint, read_sidecar
from ds4lib.tools.cli import main as ds4_main

ROOT = Path(__file__).resolve().parents[2]
BASE = ROOT / "models" / "ds4-tiny-base.gguf"
SIDECARS = ROOT / "models" / "sidecars"
SHIPPED = ROOT / "models" / "posttrain" / "finance"


@pytest.fixture(scope="module")
def cfg():
    return BaseFile.open(BASE).config


def test_shipped_posttrain_reads_and_is_fingerprinted_to_the_finance_sidecar(cfg):
    pt = read_sidecar(SHIPPED, cfg, expect_kind="posttrain")
    sc = read_sidecar(SIDECARS / "finance", cfg, expect_kind="sidecar")
    assert pt.base_fnv == sc.fingerprint == (SHIPPED / "base.fnv").read_text().strip()
    last = cfg.n_layers - 1
    assert list(pt.gains) == [last] and not pt.bias                    # the last layer's gains only
    assert (pt.gains[last] != 1).any()
    rep = json.loads((SHIPPED / "report.json").read_text())
    assert rep["status"] == "installed" and rep["gate"]["passed"]
    assert rep["fingerprint"] == pt.fingerprint == directory_fingerprint(SHIPPED)
    assert rep["base_fnv"] == sc.fingerprint
    assert rep["real"]["flipped_share"] >= 0.9 and rep["real"]["kept_share"] >= 0.997   # the real numbers too
    assert rep["judge"]["passed"] and rep["judge"]["max_drop_pp"] <= 0.2                 # the judging slices too
    assert all(s["drop_pp"] <= 0.2 for s in rep["judge"]["slices"].values())
    assert sum(f.stat().st_size for f in SHIPPED.iterdir()) < 1 << 20                  # small


def test_shipped_posttrain_mounts_on_its_stack_and_changes_the_logits(cfg):
    two = Engine(BASE, zchain=SIDECARS / "finance")
    three = Engine(BASE, zchain=SIDECARS / "finance", posttrain=SHIPPED)
    assert three.posttrain.fingerprint == directory_fingerprint(SHIPPED)
    rep = json.loads((SHIPPED / "report.json").read_text())
    ids = encode_chat(two.tokenizer, [{"role": "user", "content": "What does 'weepy' mean?"}])
    assert not np.array_equal(two.logits(ids)[-1], three.logits(ids)[-1])
    assert rep["params"]["zchain_fnv"] == two.sidecar.fingerprint


def test_ds4_runs_with_the_shipped_posttrain(capsys):
    argv = ["-m", str(BASE), "--zchain", str(SIDECARS / "finance"), "--posttrain", str(SHIPPED), "-p", "Hi",
            "-n", "2", "--temp", "0"]
    assert ds4_main(argv) == 0, capsys.readouterr().err


@pytest.mark.parametrize("other", ["code", "law", "medicine", "science"])
def test_shipped_posttrain_is_refused_on_another_sidecar(other):
    with pytest.raises(EngineError, match="refusing the mismatched pair"):
        Engine(BASE, zchain=SIDECARS / other, posttrain=SHIPPED)


def test_shipped_posttrain_is_refused_without_a_sidecar_and_by_the_cli(capsys):
    with pytest.raises(EngineError, match="stacks on a sidecar"):
        Engine(BASE, posttrain=SHIPPED)
    argv = ["-m", str(BASE), "--zchain", str(SIDECARS / "law"), "--posttrain", str(SHIPPED), "-p", "Hi",
            "-n", "1"]
    assert ds4_main(argv) == 2
    assert "refusing the mismatched pair" in capsys.readouterr().err
