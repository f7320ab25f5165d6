"""Numba CUDA kernels of ds4: one op family per module, each with `<op>_kernel`(s), UPPER_CASE compile-time
constants, a host launcher `<op>(...)` (validates, sizes the grid, launches; no math of its own) and
`SIGNATURES` {kernel name: Numba signature} compiled for sm_90 by the tests.

Kernels import numpy, numba and ds4lib.formats constants only; no I/O and no model objects. This file also reads
`ds4lib.config.Env` (the one reader of the environment) for the kernel cache's home, and hashes the kernel sources
once at import (below).

Every `@cuda.jit` kernel begins with `kernels.pdl.grid_entry_device()` (the grid-dependency wait of programmatic
graph edges, docs/toolchain.md §4.8) and is declared with `cache=True`: numba-cuda keeps its compiled code (LLVM IR,
PTX, cubin) on disk, so a later process loads it instead of compiling (docs/toolchain.md §4.5). The cache lives in
`KERNEL_CACHE_DIR` = Env.kernel_cache_dir / "kernels-<hash of the kernel sources>". Numba keys a cached kernel by its
own bytecode, its closure variables and its file's mtime and size, but not by the device functions it calls from
other modules (kernels.bf16, rms_norm's block sums), an intrinsic's PTX text or the ds4lib.formats constants it
freezes; the source hash in the directory name covers those, so an edit anywhere in kernels/ starts a fresh cache
rather than loading stale code. Old `kernels-*` directories are never read again and may be deleted.

`bounded_jit(threads, min_blocks)` is that decorator for a kernel launched with at most `threads` threads a block:
on the GPU it passes the launch bounds to ptxas, which then keeps the kernel's registers within what `min_blocks`
resident blocks of that size may use (the simulator takes no bounds).

`@inline_device` declares a device function: NVVM inlines it into its callers on the GPU.

`smem_launch(kernel, grid, threads, stream, smem)` configures a launch with `smem` bytes of dynamic shared memory,
opting the compiled kernel in past 48 KB of static + dynamic shared memory (at most SMEM_LIMIT) on the GPU.

`on_bytes(ary, n)` says whether a device array's first byte lies on n bytes (the 16-byte loads and copies of the
q4_K kernels and the L2 prefetch need it of their weights; always true in the simulator, whose arrays have no device
addresses).

`rows_grid(x_blocks, n_rows)` is the grid of a launcher that puts rows or tokens on the y axis (kernels.hc,
kernels.vq_gemv: no 64-bit division of a flat index, docs/toolchain.md §4.9): at most GRID_Y_MAX (CUDA's largest
grid y) rows of blocks, and their kernels step over the rest by gridDim.y.
"""
import hashlib as _hashlib
import os as _os
import re as _re
from pathlib import Path as _Path

import numpy as _np

from ds4lib.config import Env as _Env

# numba-cuda 0.30 registers np.row_stack, which numpy 2.5 removed (docs/toolchain.md §4.1): restore the alias
# before anything compiles. Done here, once, for every kernel module.
if not hasattr(_np, "row_stack"):
    _np.row_stack = _np.vstack

from numba.cuda.core import config as _cuda_config  # noqa: E402  (after the alias)

from kernels import numba_fix as _numba_fix  # noqa: E402

# numba-cuda's lowering scans a block's assignments once per variable (quadratic in our inlined kernels' blocks):
# kernels/numba_fix.py gives it the same answer in one pass, before anything compiles
_numba_fix.install()

# Decode launches grids of a few blocks by design (one token, a handful of experts); numba-cuda warns about every
# grid under 128 blocks, which floods the CLI's stderr. Turned off here unless the user asked for it.
if "NUMBA_CUDA_LOW_OCCUPANCY_WARNINGS" not in _os.environ:
    _cuda_config.CUDA_LOW_OCCUPANCY_WARNINGS = 0


def source_fingerprint(here: _Path = _Path(__file__).resolve().parent) -> str:
    """sha256 (16 hex digits) of every `here`/*.py (this package) and of the ds4lib/formats modules they import
    constants from (`here` is a sibling of ds4lib/, in a checkout and in site-packages alike)."""
    files = sorted(here.glob("*.py"))
    formats = here.parent / "ds4lib" / "formats"
    imported = set()
    for p in files:
        imported.update(_re.findall(r"^from ds4lib\.formats\.(\w+) import", p.read_text(), _re.M))
    h = _hashlib.sha256()
    for p in files + [formats / f"{m}.py" for m in sorted(imported)]:
        h.update(f"{p.parent.name}/{p.name}\0".encode())
        h.update(p.read_bytes())
    return h.hexdigest()[:16]


KERNEL_CACHE_DIR = _Env.read().kernel_cache_dir / f"kernels-{source_fingerprint()}"

# numba-cuda's cache locator reads this when each `cache=True` kernel is decorated, i.e. when its module is first
# imported, which is always after this package's __init__. Set on numba-cuda's config rather than as
# NUMBA_CACHE_DIR in os.environ: child processes then resolve the same root themselves instead of nesting a second
# kernels-<hash> level under an inherited one.
_cuda_config.CACHE_DIR = str(KERNEL_CACHE_DIR)


GRID_Y_MAX = 65535


def on_bytes(ary, n):
    """Whether the device array's first byte lies on n bytes (True in the simulator; an empty array: address 0)."""
    return bool(_cuda_config.ENABLE_CUDASIM) or int(ary.device_ctypes_pointer.value or 0) % n == 0


def rows_grid(x_blocks, n_rows):
    """(x_blocks, rows of blocks on y): n_rows (>= 1) capped at GRID_Y_MAX; the kernel steps by gridDim.y."""
    return (x_blocks, min(n_rows, GRID_Y_MAX))


def inline_device(fn):
    """`cuda.jit(device=True)` for a device function that its callers inline. On the GPU NVVM inlines it
    (`forceinline=True`: LLVM's alwaysinline) rather than numba's IR-level `inline=True`, which deep-copies the
    callee's IR at every call site and spent most of a large kernel's compile (docs/toolchain.md §3: all kernels for
    sm_90 in 241 s against 753 s on the dev box, the step no slower on an H100, BENCHMARKS.md, thirty-seventh
    session). The simulator's jit takes neither option and runs it as a call."""
    from numba import cuda
    if _cuda_config.ENABLE_CUDASIM:
        return cuda.jit(device=True)(fn)
    return cuda.jit(device=True, forceinline=True)(fn)


def bounded_jit(threads, min_blocks=1):
    """`cuda.jit(cache=True)` with launch bounds (threads, min_blocks) on the GPU; without them in the simulator.
    Numba's on-disk cache key holds the function's bytecode and closure values, not its launch bounds: a factory
    that makes one kernel under several bounds in one source tree (a probe's variants) names the bound in the
    kernel's body, so that it is a closure value and each variant gets its own entry."""
    from numba import cuda
    if _cuda_config.ENABLE_CUDASIM:
        return cuda.jit(cache=True)
    return cuda.jit(launch_bounds=(threads, min_blocks), cache=True)


SMEM_LIMIT = 227 * 1024          # static + dynamic shared memory one block may use on sm_90
_SMEM_MAX = {}


def raise_smem_limit(nbytes):
    """A pre-launch callback that lets a kernel use `nbytes` of dynamic shared memory (past 48 KB of static + dynamic
    needs opting in). The limit is a property of the compiled function: it is only ever raised (launches of one
    kernel with several sizes share it, and lowering it for a small one would make the next large launch invalid)."""
    def callback(kernel, launch_config):
        from numba.cuda.cudadrv.driver import binding, driver
        cufunc = kernel._codelibrary.get_cufunc()
        key = id(cufunc)
        if _SMEM_MAX.get(key, 0) >= nbytes:
            return
        attr = binding.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
        driver.cuKernelSetAttribute(attr, int(nbytes), cufunc.handle, cufunc.device.id)
        _SMEM_MAX[key] = nbytes
    return callback


def smem_launch(kernel, grid, threads, stream, smem):
    """kernel[grid, threads, stream, smem], with raise_smem_limit(smem) registered on the GPU (numba caches
    configured launches, so once per configuration) when smem > 0: the kernel's static shared memory is not known
    here, and opting in to a size it does not need changes nothing."""
    launch = kernel[grid, threads, stream, smem]
    if not _cuda_config.ENABLE_CUDASIM and smem > 0 and not launch.pre_launch_callbacks:
        launch.pre_launch_callbacks.append(raise_smem_limit(smem))
    return launch
