"""`ds4 inspect` and `ds4 tiny` through the real console entry point."""
import json

from ds4lib.formats.checkpoint import CheckpointReader
from ds4lib.tools.cli import main


def test_inspect_v41_reports_released_figures(capsys):
    assert main(["inspect", "v41-flash"]) == 0
    out = capsys.readouterr().out
    assert "384,006,168" in out and "384,016,682" in out
    assert "total                 762.720 B" in out
    assert "publishes candidates" in out and "dspark stage 2" in out


def test_inspect_json_of_a_checkpoint(official_dir, capsys):
    assert main(["inspect", str(official_dir / "checkpoint"), "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["engram"]["table_rows"] == [6126, 6332]
    assert rep["tensors"]["count"] == 1962
    assert [r["kind"] for r in rep["roles"]][:3] == ["SWA", "SWA", "KV source, index source"]


def test_inspect_bad_input(tmp_path, capsys):
    assert main(["inspect", "nonsense-preset"]) == 2
    (tmp_path / "config.json").write_text("{not json")
    assert main(["inspect", str(tmp_path)]) == 2
    assert "not valid JSON" in capsys.readouterr().out


def test_tiny_writes_a_loadable_checkpoint(tmp_path):
    assert main(["tiny", "--out", str(tmp_path / "t"), "--seed", "5"]) == 0
    r = CheckpointReader.open(tmp_path / "t")
    assert r.cfg.n_layers == 8 and r.has("mtp.1.markov_head.embed.weight")
