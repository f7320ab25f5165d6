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


def test_a_group_of_files_lands_on_one_shard_as_one_unit():
    weights = {"tests/a.py": 100.0, "tests/b.py": 90.0, "tests/c.py": 60.0, "tests/d.py": 50.0, "tests/e.py": 10.0}
    alone = shards.assign(list(weights), 2, weights)
    assert alone == {"tests/a.py": 0, "tests/b.py": 1, "tests/c.py": 1, "tests/d.py": 0, "tests/e.py": 0}
    got = shards.assign(list(weights), 2, weights, together={"tests/c.py": "tests/b.py", "tests/e.py": "tests/b.py"})
    assert got == {"tests/a.py": 1, "tests/b.py": 0, "tests/c.py": 0, "tests/d.py": 1, "tests/e.py": 0}  # b+c+e: 160
    assert shards.assign(list(weights), 2, weights, together={"tests/c.py": "tests/zz.py"}) == alone  # no such lead


def test_files_reading_ptx_go_with_the_compile_test(tmp_path):
    (tmp_path / "tests" / "kernels").mkdir(parents=True)
    texts = {"tests/kernels/test_compile_sm90.py": "compile_all(workers=2)  # compile_sm90.ptx_counts",
             "tests/kernels/test_a.py": "r = ptx_counts(names, ['x'])",
             "tests/kernels/test_b.py": "from tests.kernels.compile_sm90 import ptx_texts\nptx_texts(['m:k'])",
             "tests/kernels/test_c.py": "from tests.kernels.compile_sm90 import ROOT"}
    for name, text in texts.items():
        (tmp_path / name).write_text(text)
    want = {"tests/kernels/test_a.py": shards.PTX_SOURCE, "tests/kernels/test_b.py": shards.PTX_SOURCE}
    assert shards.ptx_groups(list(texts), root=tmp_path) == want
    assert shards.ptx_groups([f for f in texts if "compile" not in f], root=tmp_path) == {}
    real = shards.ptx_groups([shards.PTX_SOURCE, "tests/kernels/test_hc.py", "tests/kernels/test_moe.py"])
    assert real == {"tests/kernels/test_hc.py": shards.PTX_SOURCE}       # the fused mixes' ticket test reads PTX


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


_SEEDED = """
import json, sys
from tests import shards
files, weights, together = json.loads(sys.stdin.read())
print(json.dumps(shards.assign(files, 2, weights, together=together), sort_keys=True))
"""


def test_every_process_assigns_alike_whatever_its_hash_seed():
    """Each shard's pytest computes the assignment itself, so processes with different PYTHONHASHSEEDs must agree:
    a group whose members' seconds sum to a float that depends on their order (0.1 + 0.2 + 0.3), a file of that
    sum, files of no seconds (they follow the lighter shard), and the real suite's files and table."""
    import json
    synth_w = {"tests/g.py": 0.0, "tests/g1.py": 0.1, "tests/g2.py": 0.2, "tests/g3.py": 0.3, "tests/x.py": 0.6,
               "tests/y.py": 0.3}
    synth_w.update({f"tests/z{i}.py": 0.0 for i in range(12)})
    synth_t = {f"tests/g{i}.py": "tests/g.py" for i in (1, 2, 3)}
    real = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*.py"))
    cases = [(list(synth_w), synth_w, synth_t), (real, shards.read_weights(), shards.ptx_groups(real))]
    for files, weights, together in cases:
        outs = set()
        for seed in range(6):
            env = {**os.environ, "PYTHONHASHSEED": str(seed)}
            r = subprocess.run([sys.executable, "-c", _SEEDED], cwd=ROOT, env=env, input=json.dumps(
                [files, weights, together]), capture_output=True, text=True, timeout=60)
            assert r.returncode == 0, r.stderr
            outs.add(r.stdout)
        assert len(outs) == 1, f"{len(outs)} different assignments of {len(files)} files"


def test_the_shards_of_a_collection_partition_it_by_whole_files():
    files = ["tests/test_config.py", "tests/formats/test_q4k.py", "tests/formats/test_vq.py",
             "tests/formats/test_number_formats.py"]
    whole = _collected(None, files)
    parts = [_collected(f"{i}/2", files) for i in range(2)]
    assert whole and all(parts)
    assert parts[0] | parts[1] == whole and not parts[0] & parts[1]
    per_file = [{t.split("::")[0] for t in p} for p in parts]
    assert not per_file[0] & per_file[1]
