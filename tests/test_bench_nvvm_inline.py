"""bench/dev/nvvm_inline.py: after install(), kernel modules' inline device functions are NVVM-inlined
(forceinline instead of numba's IR inlining), the kernel cache moves to a directory of its own, and a kernel that
calls device functions of three modules compiles to sm_90 PTX with every call inlined; installing after a kernel
module was imported is refused; under the simulator it does nothing."""
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

PROBE = """
import json, sys
sys.path.insert(0, ".")
import bench.dev.nvvm_inline as n
from numba.cuda.core import config
import kernels
before = config.CACHE_DIR
on = n.install()
again = n.install()
import kernels.rope as r
import kernels.bf16 as b
out = {"on": on, "again": again, "before": before, "after": config.CACHE_DIR, "dir": str(kernels.KERNEL_CACHE_DIR)}
if on:
    from tests.kernels.compile_sm90 import _compiler, _ptx_of
    ptx = _ptx_of(_compiler(), r.rope_kernel, r.SIGNATURES["rope_kernel"])
    out.update(opts=[b.round_bf16_device.targetoptions.get(k) for k in ("inline", "forceinline")],
               sm90=".target sm_90" in ptx, calls=ptx.count("call.uni"), funcs=ptx.count(".func "))
print(json.dumps(out))
"""


def _run(code, sim):
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    if sim:
        env["NUMBA_ENABLE_CUDASIM"] = "1"
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def test_install_maps_inline_device_functions_to_nvvm_and_moves_the_cache():
    r = _run(PROBE, sim=False)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["on"] and got["again"]
    assert got["before"] == got["dir"] and got["after"] == got["dir"] + "-nvvm"
    assert got["opts"] == ["never", True]
    assert got["sm90"] and got["calls"] == 0 and got["funcs"] == 0, got


def test_install_refuses_after_a_kernel_module_and_skips_the_simulator():
    r = _run("import sys; sys.path.insert(0, '.'); import kernels.warp, bench.dev.nvvm_inline as n; n.install()",
             sim=False)
    assert r.returncode != 0 and "already imported (kernels.warp)" in r.stderr
    r = _run(PROBE, sim=True)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["on"] is False and got["after"] == got["before"]
