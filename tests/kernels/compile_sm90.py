"""Compile every kernel of `kernels/` for sm_90 without a GPU and print one JSON line per kernel.

Run in its own process (the simulator cannot compile PTX): `python -m tests.kernels.compile_sm90 [--shard I/N]`
(`--shard I/N` compiles every N-th kernel from the I-th, so N children can share the work).
Each kernel module lists `SIGNATURES` {kernel name: Numba signature}.

`--cache` prints instead, per kernel, what numba-cuda's on-disk cache would do with it, without compiling: whether the
dispatcher has the cache (`cache=True`), its cache directory, the index file it shares with the other kernels of the
same function (a factory's kernels share one) and a hash of the index key a lookup of its signature uses.

`ptx_counts(["module:kernel", ...], [pattern, ...])` (for tests) compiles the named kernels the same way in a child
process and returns {"module:kernel": {pattern: occurrences in its PTX, ..., "sm90": bool}}.
"""
import importlib
import json
import os
import pkgutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


class _FakeDevice:
    compute_capability = (9, 0)
    id = 0
    name = b"sm_90 (no device)"


def _compiler():
    import numba.cuda
    import numba.cuda.dispatcher as disp
    disp.get_current_device = lambda: _FakeDevice()   # device functions resolve their target without a driver
    return numba.cuda


def ptx_counts(targets, patterns):
    """Occurrences of each pattern in the sm_90 PTX of each "module:kernel" (compiled in a child process)."""
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    cmd = [sys.executable, "-m", "tests.kernels.compile_sm90", "--count", json.dumps([list(targets), list(patterns)])]
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    if p.returncode != 0:
        raise RuntimeError(f"PTX compilation failed:\n{p.stderr[-3000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def _count(spec):
    targets, patterns = json.loads(spec)
    cuda = _compiler()
    out = {}
    for t in targets:
        mod_name, kname = t.split(":")
        mod = importlib.import_module(f"kernels.{mod_name}")
        ptx, _ = cuda.compile_ptx(getattr(mod, kname).py_func, mod.SIGNATURES[kname], cc=(9, 0))
        out[t] = {pat: ptx.count(pat) for pat in patterns}
        out[t]["sm90"] = ".target sm_90" in ptx
    print(json.dumps(out))
    return 0


class _Codegen:
    """Stands in for the CUDA codegen, whose part of the key (CUDA runtime version, compute capability) needs a
    device and is the same for every kernel of a process."""

    def magic_tuple(self):
        return ("sm_90",)


def _cache_keys():
    import hashlib
    _compiler()
    import kernels
    from numba.cuda.dispatcher import CUDACache
    for info in pkgutil.iter_modules(kernels.__path__):
        mod = importlib.import_module(f"kernels.{info.name}")
        for kname, sig in getattr(mod, "SIGNATURES", {}).items():
            disp = getattr(mod, kname)
            cache = disp._cache
            cached = isinstance(cache, CUDACache)
            probe = cache if cached else CUDACache(disp.py_func)      # the key it would have with cache=True
            key = probe._index_key(sig, _Codegen())
            print(json.dumps({"module": info.name, "kernel": kname, "cached": cached,
                              "dir": cache.cache_path if cached else None, "index": probe._impl.filename_base,
                              "key": hashlib.sha256(repr(key).encode()).hexdigest()}))
    return 0


def all_kernels():
    """[(module name, kernel name, signature)] of every kernel listed in a SIGNATURES table, in a fixed order."""
    import kernels
    out = []
    for info in pkgutil.iter_modules(kernels.__path__):
        mod = importlib.import_module(f"kernels.{info.name}")
        out += [(info.name, kname, sig) for kname, sig in getattr(mod, "SIGNATURES", {}).items()]
    return out


def main():
    if len(sys.argv) == 3 and sys.argv[1] == "--count":
        return _count(sys.argv[2])
    if len(sys.argv) == 2 and sys.argv[1] == "--cache":
        return _cache_keys()
    shard, shards = 0, 1                          # `--shard I/N`: kernels I, I+N, I+2N, ... (parallel children)
    if len(sys.argv) == 3 and sys.argv[1] == "--shard":
        shard, shards = (int(v) for v in sys.argv[2].split("/"))
    numba_cuda = _compiler()
    results = []
    for j, (mod_name, kname, sig) in enumerate(all_kernels()):
        if j % shards != shard:
            continue
        fn = getattr(importlib.import_module(f"kernels.{mod_name}"), kname)
        try:
            ptx, _ = numba_cuda.compile_ptx(fn.py_func, sig, cc=(9, 0), fastmath=False)
            ok = ".target sm_90" in ptx
            results.append({"module": mod_name, "kernel": kname, "ok": ok, "ptx_bytes": len(ptx),
                            "shfl": "shfl.sync" in ptx, "atom": "atom." in ptx, "mma": "mma.sync" in ptx})
        except Exception as e:   # noqa: BLE001 - reported to the test
            results.append({"module": mod_name, "kernel": kname, "ok": False, "error": f"{type(e).__name__}: {e}"})
    for r in results:
        print(json.dumps(r))
    return 0 if results and all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    os.environ.pop("NUMBA_ENABLE_CUDASIM", None)    # only in this child process: the simulator cannot make PTX
    sys.exit(main())
