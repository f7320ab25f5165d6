"""bench/bench_kernels.py --small runs every case under the simulator (so the benchmark cannot rot)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_bench_small_runs_every_case():
    env = {k: v for k, v in os.environ.items() if k != "DS4_REQUIRE_CUDA"}
    p = subprocess.run([sys.executable, "bench/bench_kernels.py", "--small"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    rows = [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]
    names = {r["kernel"] for r in rows}
    assert rows[0]["kernel"] == "device_copy"
    for family in ("gemv.", "rope.", "hc.", "attention.", "compressor.", "indexer.", "moe.", "engram.", "sampling."):
        assert any(n.startswith(family) for n in names), family
    assert len(rows) >= 33 and all(r["mode"] == "simulator" and r["bytes"] > 0 for r in rows)
