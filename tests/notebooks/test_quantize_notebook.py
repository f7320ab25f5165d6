"""notebooks/quantize.ipynb executes end to end with tiny parameters, and stays thin."""
import json
from pathlib import Path

import nbformat
import pytest

from ds4lib.config import ModelConfig
from ds4lib.synth import write_random_checkpoint
from tests.notebooks.thin import thin_code_cells

NB = Path(__file__).resolve().parents[2] / "notebooks" / "quantize.ipynb"


def test_notebook_is_thin():
    thin_code_cells(NB)


def test_notebook_runs_with_tiny_parameters(tmp_path):
    papermill = pytest.importorskip("papermill")
    cfg = ModelConfig.tiny().replace(n_routed_experts=4, n_activated_experts=2, moe_inter_dim=64,
                                     dspark_n_routed_experts=2, dspark_n_activated_experts=1)
    ck = write_random_checkpoint(tmp_path / "ck", cfg, seed=11)
    summary = tmp_path / "summary.json"
    papermill.execute_notebook(str(NB), str(tmp_path / "out.ipynb"), kernel_name="python3", progress_bar=False,
                               cwd=str(NB.parents[1]),
                               parameters={"checkpoint": str(ck), "output": str(tmp_path / "base.gguf"),
                                           "rounds": 1, "curve_bits": [8, 9], "curve_rounds": 1,
                                           "measure_layers": [0], "compare_bits": 8, "summary_json": str(summary)})
    doc = json.loads(summary.read_text())
    res = doc["results"]
    assert res["file_errors"]["max_abs_diff"] < 1e-12
    assert len(res["layers"]) == cfg.n_all_layers and len(res["bitwidth_curve"]) == 2
    assert res["size_table"]["total_bytes"] == (tmp_path / "base.gguf").stat().st_size
    out = nbformat.read(tmp_path / "out.ipynb", as_version=4)
    assert sum(1 for c in out.cells for o in c.get("outputs", []) if "image/png" in o.get("data", {})) == 3
