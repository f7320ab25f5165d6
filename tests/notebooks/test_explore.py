"""notebooks/explore.ipynb executes headlessly with tiny parameters (a small random stack), and stays thin.

The widgets do not render without a front end, but they are built, and the parameter run presses the Generate
button, so the handler a person triggers in JupyterLab runs here end to end: streaming into the widgets,
teacher-forced top candidates of ours vs the original model, and the summary.
"""
from __future__ import annotations

import json
from pathlib import Path

import nbformat
import papermill
import pytest

from tests.server.stack import build_tiny_stack

NB = Path(__file__).resolve().parents[2] / "notebooks" / "explore.ipynb"


def test_notebook_is_thin():
    nb = nbformat.read(NB, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert nb.cells[0].cell_type == "markdown" and "parameters" in code[0].metadata.get("tags", [])
    assert all(not c.outputs and c.execution_count is None for c in code), "commit with outputs stripped"
    callback_cells = [c for c in code if "callbacks" in c.metadata.get("tags", [])]
    assert len(callback_cells) == 1, "widget handlers live in the one cell tagged 'callbacks'"
    for c in code:
        allowed = ("def on_", "for ") if c in callback_cells else ()
        for raw in c.source.splitlines():
            line = raw.lstrip()
            assert len(raw) <= 120, raw
            if line.startswith(("def ", "class ", "for ", "while ")):
                assert line.startswith(allowed), f"not thin: {line}"
    assert sum(line.lstrip().startswith("def ") for line in callback_cells[0].source.splitlines()) == 1


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    return build_tiny_stack(tmp_path_factory.mktemp("explore_stack"))


def _run(tmp_path, stack, **params):
    base, ck = stack
    summary = tmp_path / "summary.json"
    papermill.execute_notebook(str(NB), str(tmp_path / "out.ipynb"), kernel_name="python3", progress_bar=False,
                               cwd=str(NB.parents[1]),
                               parameters={"base": str(base), "checkpoint": str(ck), "sidecar_root": str(tmp_path),
                                           "teacher_cache": str(tmp_path / "teacher"),
                                           "summary_json": str(summary), **params})
    return json.loads(summary.read_text()), nbformat.read(tmp_path / "out.ipynb", as_version=4)


def test_notebook_runs_with_tiny_parameters(tmp_path, stack):
    doc, out = _run(tmp_path, stack, prompt="hi", temperature=0.0, max_tokens=6, top_n=3)
    res = doc["results"]
    assert res["domain"] == "none" and res["tokens"] == 6 and res["answer"]
    assert len(res["rows"]) == 6
    for r in res["rows"]:
        assert len(r["ours"]) == len(r["original"]) == 3
        assert [p for _, p in r["ours"]] == sorted((p for _, p in r["ours"]), reverse=True)
        assert 0.0 <= r["sigma_min"] <= 1.0 + 1e-9 and r["kl"] >= -1e-9
        assert r["same_top1"] == (r["ours"][0][0] == r["original"][0][0])
    assert r["token"] == r["ours"][0][0], "greedy: every generated token is our top-1 candidate"
    assert 0.0 <= res["same_top1"] <= 1.0
    tables = [o for c in out.cells for o in c.get("outputs", []) if "text/markdown" in o.get("data", {})]
    assert any("Ours vs the original" in t["data"]["text/markdown"] for t in tables)


def test_notebook_says_a_missing_sidecar_is_not_built(tmp_path, stack):
    doc, _ = _run(tmp_path, stack, domain="finance", max_tokens=2)
    assert "sidecar for finance is not built" in doc["results"]["status"]
    assert "rows" not in doc["results"]


def test_notebook_names_a_bad_parameter(tmp_path, stack):
    with pytest.raises(papermill.PapermillExecutionError) as err:
        _run(tmp_path, stack, domain="nosuch")
    assert "domain: 'nosuch' is not one of none, finance" in str(err.value)
    assert not (tmp_path / "summary.json").exists(), "stopped before the run wrote anything"
