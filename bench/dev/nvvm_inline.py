"""Dev knob (not used by the engine): compile the kernels with their device functions inlined by NVVM
(`cuda.jit(device=True, forceinline=True)`: LLVM's alwaysinline) instead of numba's IR-level inlining
(`inline=True`, what kernels/ declare), to time and compare the two builds.

Why. Numba's IR-level inlining deep-copies a callee's IR at every call site, and most of a large kernel's compile is
spent there (docs/toolchain.md §3). On the dev box, compiling all 104 kernels of the SIGNATURES tables for sm_90 and
assembling them (bench/dev/sass_probe.py --contiguous, two processes side by side) took 753 s with numba's inlining
and 241 s with NVVM's (thirty-sixth session). The SASS is not the same for every kernel (BENCHMARKS.md): a GPU A/B
and the GPU tests decide before kernels/ changes its decorators.

Use it before any kernel module is imported, e.g. with bench/dev/knobs.py:

    python bench/dev/knobs.py --exec "import bench.dev.nvvm_inline as n; n.install()" -- bench/bench_v41_decode.py ...

`install()` maps every later `cuda.jit(device=True, inline=True)` to `cuda.jit(device=True, forceinline=True)` and
moves numba-cuda's kernel cache to a directory of its own (KERNEL_CACHE_DIR + "-nvvm"): a kernel's cache key does not
see how its callees were inlined, so the two builds must not share entries. On the simulator it does nothing (the
simulator's jit has no forceinline; it inlines nothing).
"""
import sys

SUFFIX = "-nvvm"


def install():
    """Installs the mapping (idempotent). Raises RuntimeError if a kernel module was imported already."""
    import numba.cuda as nc
    import numba.cuda.decorators as dec
    from numba.cuda.core import config

    import kernels
    if config.ENABLE_CUDASIM:
        return False
    early = sorted(m for m in sys.modules if m.startswith("kernels.") and m != "kernels.numba_fix")
    if early:
        raise RuntimeError(f"nvvm_inline.install: kernel modules already imported ({', '.join(early)}): their device "
                           f"functions keep numba's inlining")
    if getattr(dec.jit, "nvvm_inline", False):
        return True
    original = dec.jit

    def jit(*args, **kw):
        if kw.get("device") and kw.get("inline") in (True, "always"):
            kw["inline"] = "never"
            kw["forceinline"] = True
        return original(*args, **kw)

    jit.nvvm_inline = True
    nc.jit = dec.jit = jit
    config.CACHE_DIR = str(kernels.KERNEL_CACHE_DIR) + SUFFIX
    return True
