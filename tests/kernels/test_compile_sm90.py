"""Every kernel compiles for sm_90 (Hopper) on a machine without a GPU."""
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_all_kernels_compile_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    p = subprocess.run([sys.executable, "-m", "tests.kernels.compile_sm90"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=1200)
    rows = [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]
    failed = [r for r in rows if not r["ok"]]
    assert rows, f"no kernel was compiled:\n{p.stderr[-3000:]}"
    assert not failed, failed
    assert p.returncode == 0, p.stderr[-3000:]
    names = {r["kernel"] for r in rows}
    assert "rms_norm_kernel" in names
    assert next(r for r in rows if r["kernel"] == "rms_norm_kernel")["shfl"]
