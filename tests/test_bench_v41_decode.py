"""bench/bench_v41_decode.py --small runs the real-size decode benchmark's whole path under the simulator (micro model,
one eager step: the simulator has no graphs), so the benchmark cannot rot."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_bench_v41_decode_small_runs(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "DS4_REQUIRE_CUDA"}
    out = tmp_path / "v41.jsonl"
    p = subprocess.run([sys.executable, "bench/bench_v41_decode.py", "--small", "--out", str(out)], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=1500)
    assert p.returncode == 0, p.stderr[-3000:]
    rows = [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]
    assert [json.loads(line) for line in out.read_text().splitlines()] == rows
    run, ctx = rows[0], rows[1:]
    assert run["kind"] == "run" and run["weight_bytes"] > 0 and run["roofline"]["roofline_tbps"] > 0
    assert run["bits"] == [13, 12] and sum(run["weight_bytes_per_token"].values()) > 0
    assert [r["context"] for r in ctx] == [8]
    assert "graph" not in ctx[0]
    for mode in ("eager",):
        x = ctx[0][mode]
        assert x["tokens_per_s"] > 0 and x["kernel_launches_per_token"] > 10 and 0 <= x["last_token"] < 64
    assert "per-op" in p.stdout or "no per-op table" in p.stdout
