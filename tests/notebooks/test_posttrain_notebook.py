"""notebooks/posttrain.ipynb stays thin, and executes end to end on the ③ tests' micro stack (a random ② on the micro
base, requests built so that the model's greedy answer leaves the right one at a known token)."""
import json
from pathlib import Path

import nbformat
import pytest

from ds4lib.formats.sidecar import read_sidecar
from tests.notebooks.thin import thin_code_cells
from tests.posttrain.conftest import micro_stack  # noqa: F401  (the shared micro stack fixture)
from tests.posttrain.test_posttrain_cli import MICRO, MIN_KEPT, cases, stack  # noqa: F401  (its engine and requests)

NB = Path(__file__).resolve().parents[2] / "notebooks" / "posttrain.ipynb"


def test_notebook_is_thin():
    code = thin_code_cells(NB)
    assert "save_summary" in code[-1].source
    params = {}
    exec(code[0].source, {}, params)              # literals only
    for k in ("domain", "day", "tau", "rho", "lam", "kappa"):
        assert k in params, k
    # the parameters are the entry point's: the solve cell passes each of them on by name
    assert all(f"{k}={k}" in code[2].source for k in ("tau", "rho", "lam", "kappa", "rivals", "rounds", "min_flip",
                                                     "min_kept", "keep_positions", "keep_rivals", "keep_rho",
                                                     "max_top1_drop"))


@pytest.mark.slow
def test_notebook_runs_on_the_micro_stack(stack, cases, tmp_path):  # noqa: F811
    papermill = pytest.importorskip("papermill")
    days = tmp_path / "days"
    days.mkdir()
    reqs = cases[0]
    (days / "day-1.jsonl").write_text("".join(json.dumps(r) + "\n" for r in reqs))
    (days / "day-5.jsonl").write_text("".join(json.dumps(r) + "\n" for r in reqs[:2]))
    summary = tmp_path / "summary.json"
    out = tmp_path / "pt"
    papermill.execute_notebook(str(NB), str(tmp_path / "out.ipynb"), kernel_name="python3", progress_bar=False,
                               cwd=str(NB.parents[1]),
                               parameters={"base": str(stack["base"]), "sidecars": str(stack["sc"].parent),
                                           "domain": stack["sc"].name, "day": 1, "days_dir": str(days),
                                           "heldout_days": [5], "out": str(out), "min_kept": MIN_KEPT,
                                           "keep_positions": 0, "judge": False, **MICRO,
                                           "engram_dir": str(stack["ckpt"]), "examples": 2,
                                           "summary_json": str(summary)})
    res = json.loads(summary.read_text())["results"]
    solve = res["solve"]
    assert solve["status"] == "installed" and solve["decision_points"] == len(reqs) - 1
    assert read_sidecar(out, stack["cfg"], expect_kind="posttrain").fingerprint == solve["fingerprint"]
    assert len(solve["margins"]["real"]) == solve["predicted"]["rows"] == (solve["decision_points"]
            + solve["constraint_rows"]) * solve["params"]["rivals"]
    assert [Path(e["requests"]).name for e in res["effects"]] == ["day-1.jsonl", "day-5.jsonl"]
    day1 = res["effects"][0]
    assert day1["n"] == len(reqs) and day1["decision_points"] == solve["decision_points"]
    assert day1["flipped_with_posttrain"] == solve["real"]["flipped"]         # the same rows, two measurements
    assert day1["right_after"] == solve["real"]["answers_right"]
    nb = nbformat.read(tmp_path / "out.ipynb", as_version=4)
    assert sum(1 for c in nb.cells for o in c.get("outputs", []) if "image/png" in o.get("data", {})) == 1
    text = "".join(o.get("text", "") for c in nb.cells for o in c.get("outputs", []))
    assert "predicted: flipped" in text and "installed" in text
