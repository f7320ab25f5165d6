"""Every kernel compiles for sm_90 (Hopper) on a machine without a GPU."""
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_all_kernels_compile_for_sm90():
    """Every kernel of every SIGNATURES table, split over two child processes compiling at once (the suite runs
    on 2 cores; compiling is most of this test's time)."""
    from tests.kernels.compile_sm90 import all_kernels
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    shards = 2
    procs = [subprocess.Popen([sys.executable, "-m", "tests.kernels.compile_sm90", "--shard", f"{i}/{shards}"],
                              cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(shards)]
    outs = [p.communicate(timeout=1200) for p in procs]
    rows = [json.loads(line) for out, _ in outs for line in out.splitlines() if line.startswith("{")]
    failed = [r for r in rows if not r["ok"]]
    assert rows, f"no kernel was compiled:\n{outs[0][1][-3000:]}"
    assert not failed, failed
    assert all(p.returncode == 0 for p in procs), [err[-3000:] for _, err in outs]
    want = sorted((m, k) for m, k, _ in all_kernels())
    assert sorted((r["module"], r["kernel"]) for r in rows) == want          # each kernel once, none left out
    names = {r["kernel"] for r in rows}
    assert "rms_norm_kernel" in names
    assert next(r for r in rows if r["kernel"] == "rms_norm_kernel")["shfl"]
