"""The ② sidecars committed beside ds4-tiny (models/sidecars/<domain>): each loads with the engine's reader against
the shipped ① base (fingerprint and config match), is complete, and — slow — its first layer re-solves to the same
bytes from the parameters its manifest records (layer 0 depends on nothing mounted before it)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
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


def _pinned_env() -> dict:
    """The environment of scripts/numerics.env (KEY=VALUE lines, optional quotes) over this one."""
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    for line in (ROOT / "scripts" / "numerics.env").read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            key, _, value = line.partition("=")
            env[key] = value.strip().strip('"')
    return env


def test_the_pinned_environment_pins_blas_simd_and_threads():
    env = _pinned_env()
    assert env["OPENBLAS_CORETYPE"] == "Haswell" and env["OPENBLAS_NUM_THREADS"] == "1"
    assert "X86_V4" in env["NPY_DISABLE_CPU_FEATURES"].split()


_REBUILD = """
import json, sys
from pathlib import Path
from ds4lib.sidecar import solve_sidecar
base, sc, out, cache = map(Path, sys.argv[1:5])
notes = json.loads((sc / "manifest.json").read_text())["notes"]
solve_sidecar(base=base, out=out, domain=notes["domain"], fit=notes["fit"], lambdas=notes["lambdas"],
              alphas=notes["alphas"], gate=notes["gate"], sweeps=notes["sweeps"], min_events=notes["min_events"],
              windows=notes["windows"], router_bias=notes["router_bias"], lattice=notes["lattice"],
              shared_ridge=notes["shared_ridge"], cache_dir=cache, progress=False, n_layers=1)
"""


@pytest.mark.slow
def test_first_layer_of_the_finance_sidecar_rebuilds_bit_for_bit(tmp_path):
    """Solved again in a child process under scripts/numerics.env (as scripts/solve_sidecars.sh solves them)."""
    sc = ROOT / "models" / "sidecars" / "finance"
    out = tmp_path / "finance"
    p = subprocess.run([sys.executable, "-c", _REBUILD, str(BASE), str(sc), str(out), str(tmp_path / "cache")],
                       cwd=ROOT, env=_pinned_env(), capture_output=True, text=True, timeout=1800)
    assert p.returncode == 0, p.stderr[-3000:]
    made = sorted(p.name for p in out.iterdir() if p.name.endswith("_L00.bin"))
    assert made, "layer 0 wrote nothing"
    for name in made:
        assert (out / name).read_bytes() == (sc / name).read_bytes(), name
    assert made == sorted(p.name for p in sc.iterdir() if p.name.endswith("_L00.bin"))
