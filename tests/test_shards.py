"""The suite's shards (tests/shards.py, scripts/test.sh): every test in exactly one shard, whole files, balanced."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests import shards

ROOT = Path(__file__).resolve().parent.parent


def test_assign_puts_each_file_on_one_shard_balanced_and_in_any_order():
    weights = {f"tests/t{i}.py": float(w) for i, w in enumerate([300, 160, 150, 130, 60, 60, 40, 33, 30, 20, 9, 1])}
    files = list(weights) + ["tests/new_a.py", "tests/new_b.py"]          # two files the table lacks
    got = shards.assign(files, 2, weights)
    assert sorted(got) == sorted(files) and set(got.values()) == {0, 1}
    assert shards.assign(list(reversed(files)) + files[:3], 2, weights) == got
    load = [sum(weights.get(f, shards.DEFAULT_SECONDS) for f, k in got.items() if k == j) for j in range(2)]
    assert abs(load[0] - load[1]) <= 2                                 # 499 against 498 here
    assert got["tests/t0.py"] == 0 and got["tests/t1.py"] == 1 and got["tests/t2.py"] == 1
    three = shards.assign(files, 3, weights)
    assert set(three.values()) == {0, 1, 2}


def test_parse_shard_and_its_errors():
    assert shards.parse_shard("1/3") == (1, 3)
    for bad in ("2/2", "-1/2", "1", "a/b", "1/2/3"):
        with pytest.raises(ValueError, match="DS4_TEST_SHARD"):
            shards.parse_shard(bad)


def test_weights_table_reads_back_what_main_writes(tmp_path, capsys):
    log = tmp_path / "durlog.tsv"
    log.write_text("1.50\ttests/a.py::test_x\n2.25\ttests/a.py::test_y[1]\n4.00\ttests/b.py::test_z\n")
    shards.main([str(log)])
    table = tmp_path / "w.tsv"
    table.write_text(capsys.readouterr().out)
    assert shards.read_weights(table) == {"tests/b.py": 4.0, "tests/a.py": 3.8}
    assert shards.read_weights(tmp_path / "missing.tsv") == {}


def _collected(shard, files):
    env = dict(os.environ)
    env.pop("DS4_TEST_SHARD", None)
    if shard:
        env["DS4_TEST_SHARD"] = shard
    r = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *files],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode in (0, 5), r.stdout + r.stderr
    return {line for line in r.stdout.splitlines() if re.match(r"tests/.+::", line)}


def test_the_shards_of_a_collection_partition_it_by_whole_files():
    files = ["tests/test_config.py", "tests/formats/test_q4k.py", "tests/formats/test_vq.py",
             "tests/formats/test_number_formats.py"]
    whole = _collected(None, files)
    parts = [_collected(f"{i}/2", files) for i in range(2)]
    assert whole and all(parts)
    assert parts[0] | parts[1] == whole and not parts[0] & parts[1]
    per_file = [{t.split("::")[0] for t in p} for p in parts]
    assert not per_file[0] & per_file[1]
