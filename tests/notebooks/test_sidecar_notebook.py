"""notebooks/sidecar.ipynb executes end to end on a micro model with tiny parameters, and stays thin."""
import json
from pathlib import Path

import nbformat
import numpy as np
import pytest

from ds4lib.formats.sidecar import read_sidecar
from tests.notebooks.thin import thin_code_cells

NB = Path(__file__).resolve().parents[2] / "notebooks" / "sidecar.ipynb"


def test_notebook_is_thin():
    code = thin_code_cells(NB)
    assert "save_summary" in code[-1].source


@pytest.mark.slow
def test_notebook_runs_with_tiny_parameters(tmp_path):
    papermill = pytest.importorskip("papermill")
    from ds4lib.quant.base_file import quantize_checkpoint
    from ds4lib.synth import write_random_checkpoint
    from tests.engine.test_engine_cuda import TOKENIZER
    from tests.sidecar.test_solve import micro_config
    ck = write_random_checkpoint(tmp_path / "ck", micro_config(), seed=1)
    quantize_checkpoint(checkpoint=ck, out=tmp_path / "base.gguf", bits_plan="1", rounds=1, progress=False)
    rng = np.random.default_rng(0)
    np.save(tmp_path / "fit.npy", rng.integers(9, 60, (4, 40)))
    np.save(tmp_path / "judge.npy", rng.integers(9, 60, (2, 24)))
    summary = tmp_path / "summary.json"
    papermill.execute_notebook(str(NB), str(tmp_path / "out.ipynb"), kernel_name="python3", progress_bar=False,
                               cwd=str(NB.parents[1]),
                               parameters={"base": str(tmp_path / "base.gguf"), "checkpoint": str(ck),
                                           "domain": "micro",
                                           "fit": [], "fit_tokens": str(tmp_path / "fit.npy"),
                                           "judge_slices": [str(tmp_path / "judge.npy")], "out": str(tmp_path / "sc"),
                                           "lambdas": [0.1, 10.0], "alphas": [1.0], "gate": 0.0,
                                           "tokenizer": str(TOKENIZER), "cache_dir": str(tmp_path / "cache"),
                                           "summary_json": str(summary)})
    res = json.loads(summary.read_text())["results"]
    assert len(res["solve"]["layers"]) == micro_config().n_layers
    assert sorted(read_sidecar(tmp_path / "sc", micro_config()).gains) == res["mounted"]
    assert {(r["slice"], r["stack"]) for r in res["compare"]} == {(str(tmp_path / "judge.npy"), "base"),
                                                                   (str(tmp_path / "judge.npy"), "base+sidecar")}
    out = nbformat.read(tmp_path / "out.ipynb", as_version=4)
    assert sum(1 for c in out.cells for o in c.get("outputs", []) if "image/png" in o.get("data", {})) == 3
