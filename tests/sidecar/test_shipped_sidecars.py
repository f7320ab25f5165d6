"""The ② sidecars committed beside ds4-tiny (models/sidecars/<domain>): each loads with the engine's reader against
the shipped ① base (fingerprint and config match), is complete, and — slow — its first layer re-solves to the same
bytes from the parameters its manifest records (layer 0 depends on nothing mounted before it)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from ds4lib.formats.gguf import BaseFile
from ds4lib.formats.sidecar import read_sidecar
from ds4lib.quant import file_sha256

ROOT = Path(__file__).resolve().parents[2]
BASE = ROOT / "models" / "ds4-tiny-base.gguf"
SIDECARS = sorted(p for p in (ROOT / "models" / "sidecars").glob("*") if (p / "manifest.json").exists())


def test_five_domains_are_shipped():
    assert {p.name for p in SIDECARS} >= {"finance", "code", "law", "medicine", "science"}


@pytest.mark.parametrize("sc", SIDECARS, ids=lambda p: p.name)
def test_shipped_sidecar_loads_against_the_shipped_base(sc):
    cfg = BaseFile.open(BASE).config
    man = json.loads((sc / "manifest.json").read_text())
    assert man["notes"]["status"] == "complete" and man["notes"]["domain"] == sc.name
    assert man["notes"]["base_sha256"] == file_sha256(BASE), "solved against another base"
    side = read_sidecar(sc, cfg, expect_kind="sidecar")
    assert len(side.gains) >= 1
    assert all(v["done"] for v in man["layers"].values())


@pytest.mark.slow
def test_first_layer_of_the_finance_sidecar_rebuilds_bit_for_bit(tmp_path):
    from ds4lib.sidecar import solve_sidecar
    sc = ROOT / "models" / "sidecars" / "finance"
    notes = json.loads((sc / "manifest.json").read_text())["notes"]
    out = tmp_path / "finance"
    solve_sidecar(base=BASE, out=out, domain=notes["domain"], fit=notes["fit"], lambdas=notes["lambdas"],
                  alphas=notes["alphas"], gate=notes["gate"], sweeps=notes["sweeps"], min_events=notes["min_events"],
                  windows=notes["windows"], router_bias=notes["router_bias"], lattice=notes["lattice"],
                  shared_ridge=notes["shared_ridge"], cache_dir=tmp_path / "cache", progress=False, n_layers=1)
    made = sorted(p.name for p in out.iterdir() if p.name.endswith("_L00.bin"))
    assert made, "layer 0 wrote nothing"
    for name in made:
        assert (out / name).read_bytes() == (sc / name).read_bytes(), name
    assert made == sorted(p.name for p in sc.iterdir() if p.name.endswith("_L00.bin"))
