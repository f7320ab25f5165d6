"""kernels.inline_device: the kernels' device functions are inlined by NVVM (`forceinline=True`), not by numba's
IR-level `inline=True`, whose deep copies of the callee's IR made up most of the sm_90 compile (docs/toolchain.md
§3). The simulator's jit takes neither option."""
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_no_kernel_module_asks_numba_to_inline():
    """Every device function a kernel calls goes through inline_device: a `cuda.jit(..., inline=True)` in kernels/
    (or kernels/dev/) would bring numba's IR-level inlining back into the compile."""
    offenders = [f"{p.relative_to(ROOT)}:{i}" for p in sorted((ROOT / "kernels").rglob("*.py"))
                 for i, line in enumerate(p.read_text().splitlines(), 1)
                 if re.search(r"cuda\.jit\([^)]*\binline\s*=", line)]
    assert not offenders, offenders
    assert "@inline_device" in (ROOT / "kernels" / "q4k_gemv.py").read_text()


def test_inline_device_asks_nvvm_on_the_gpu_and_nothing_of_the_simulator():
    """Off the simulator (a child process without NUMBA_ENABLE_CUDASIM; no GPU needed to decorate) the dispatcher
    carries forceinline and not numba's inlining; in the simulator it is a plain device function that runs."""
    code = ("import kernels\n"
            "d = kernels.inline_device(lambda x: x + 1)\n"
            "print(d.targetoptions['device'], d.targetoptions['forceinline'], d.targetoptions.get('inline'))\n")
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env | {"PYTHONPATH": str(ROOT)},
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["True", "True", "never"]
    code = ("import numpy as np\n"
            "from numba import cuda\n"
            "import kernels\n"
            "inc = kernels.inline_device(lambda x: x + 1)\n"
            "@cuda.jit\n"
            "def k(a):\n"
            "    a[0] = inc(a[0])\n"
            "a = np.zeros(1, np.int32)\n"
            "k[1, 1](a)\n"
            "print(a[0])\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT,
                         env=env | {"PYTHONPATH": str(ROOT), "NUMBA_ENABLE_CUDASIM": "1"},
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["1"]
