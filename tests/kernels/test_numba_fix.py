"""kernels/numba_fix.py: its set of singly assigned variables is numba-cuda's own, checked while compiling kernels
for sm_90 (in a child process: the simulator compiles nothing), and it is in place on the numba-cuda versions it was
checked against."""
import json
import subprocess
import sys

from tests.kernels.compile_sm90 import ROOT, _child_env

# The child saves numba-cuda's own method before `kernels` installs the fix, then lowers every function with a method
# that computes both sets and keeps numba-cuda's; it prints how many functions it compared and any that differed.
_CHILD = r"""
import json, sys
from numba.cuda import lowering
own = lowering.Lower._find_singly_assigned_variable
import kernels
from kernels import numba_fix
from tests.kernels import compile_sm90 as c
report = {"installed": numba_fix.installed(), "compared": 0, "differ": []}
def both(self):
    own(self)
    ours = numba_fix.singly_assigned(self)
    report["compared"] += 1
    if ours != self._singly_assigned_vars:
        report["differ"].append(self.fndesc.qualname)
lowering.Lower._find_singly_assigned_variable = both


def twice(x, n):                          # y assigned twice in one block; z in two blocks; w used in a later block
    y = x + 1
    y = y * 2
    w = y - 1
    z = 0
    for i in range(n):
        z = z + w * i
    return z + y


from types import SimpleNamespace
from numba.cuda.compiler import run_frontend
fir = run_frontend(twice)                 # untyped IR, no SSA: the cases a kernel's IR rarely shows
fake = SimpleNamespace(func_ir=fir, blocks=fir.blocks)
both(fake)
compiler = c._compiler()
sigs = {f"{m}:{k}": s for m, k, s in c.all_kernels()}
for name in sys.argv[1:]:
    m, k = name.split(":")
    assert c._compile_one(compiler, m, k, sigs[name])["ok"], name
print(json.dumps(report))
"""


def test_singly_assigned_sets_equal_numba_cudas_while_compiling():
    targets = ["rms_norm:rms_norm_q_kernel", "attention:attn_combine_kernel"]
    p = subprocess.run([sys.executable, "-c", _CHILD, *targets], cwd=ROOT, env=_child_env(), capture_output=True,
                       text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    report = json.loads(p.stdout.strip().splitlines()[-1])
    assert report["installed"], "numba_fix is not installed: is numba-cuda a version it was not checked against?"
    assert report["compared"] >= len(targets) + 1       # the frontend's IR, each kernel and the device functions
    assert report["differ"] == [], report["differ"]
