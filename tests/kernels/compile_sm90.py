"""Compile every kernel of `kernels/` for sm_90 without a GPU and print one JSON line per kernel.

Run in its own process (the simulator cannot compile PTX): `python -m tests.kernels.compile_sm90` compiles them all;
with `--serve` it reads "module:kernel" lines on stdin instead and answers each with its JSON line (PTX included), so
that `compile_all(workers)` can keep N children busy from one queue. Each kernel module lists `SIGNATURES`
{kernel name: Numba signature}.

`--cache` prints instead, per kernel, what numba-cuda's on-disk cache would do with it, without compiling: whether the
dispatcher has the cache (`cache=True`), its cache directory, the index file it shares with the other kernels of the
same function (a factory's kernels share one) and a hash of the index key a lookup of its signature uses.

`ptx_texts(["module:kernel", ...])` (for tests) returns {"module:kernel": its PTX}: the PTX that `compile_all` made
earlier in the same test session when it has them (the same compile_ptx call on the same sources), else compiled the
same way in a child process; `ptx_counts(targets, [pattern, ...])` counts patterns in them ({pattern: occurrences,
..., "sm90": bool}). Each kernel is compiled with its own launch bounds, as the GPU build does, and
`ptxas_resources(ptx)` reads the registers and spill bytes that ptxas gives it for sm_90.
"""
import importlib
import json
import os
import pkgutil
import re
import selectors
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


PTX_OF_SESSION = {}     # "module:kernel" -> sm_90 PTX, filled by compile_all(); read by ptx_counts (one process)


def _child_env():
    return {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}


def _counts(ptx, patterns):
    out = {pat: ptx.count(pat) for pat in patterns}
    out["sm90"] = ".target sm_90" in ptx
    return out


def ptx_texts(targets):
    """{"module:kernel": its sm_90 PTX}: compile_all's PTX of this session when it has them all, else compiled the
    same way (launch bounds included) in a child process."""
    if all(t in PTX_OF_SESSION for t in targets):
        return {t: PTX_OF_SESSION[t] for t in targets}
    cmd = [sys.executable, "-m", "tests.kernels.compile_sm90", "--ptx", json.dumps(list(targets))]
    p = subprocess.run(cmd, cwd=ROOT, env=_child_env(), capture_output=True, text=True, timeout=600)
    if p.returncode != 0:
        raise RuntimeError(f"PTX compilation failed:\n{p.stderr[-3000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def ptx_counts(targets, patterns):
    """Occurrences of each pattern in the sm_90 PTX of each "module:kernel" (ptx_texts)."""
    return {t: _counts(ptx, patterns) for t, ptx in ptx_texts(targets).items()}


def _ptx(spec):
    cuda = _compiler()
    out = {}
    for t in json.loads(spec):
        mod_name, kname = t.split(":")
        mod = importlib.import_module(f"kernels.{mod_name}")
        out[t] = _ptx_of(cuda, getattr(mod, kname), mod.SIGNATURES[kname])
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


_PTXAS_USED = re.compile(r"Used (\d+) registers")
_PTXAS_SPILL = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")


def ptxas_path():
    """The CUDA toolkit's ptxas (PATH, else /usr/local/cuda/bin), or None."""
    import shutil
    found = shutil.which("ptxas")
    if found:
        return found
    fallback = Path("/usr/local/cuda/bin/ptxas")
    return str(fallback) if fallback.exists() else None


def ptxas_resources(ptx, timeout=300):
    """{"registers", "spill_bytes"} of the kernel in `ptx` as ptxas assembles it for sm_90 (`-c`: fp16 helpers stay
    extern), honouring the PTX's own launch bounds; RuntimeError when ptxas is missing or fails."""
    import tempfile
    exe = ptxas_path()
    if exe is None:
        raise RuntimeError("ptxas not found (PATH or /usr/local/cuda/bin)")
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "k.ptx"
        src.write_text(ptx)
        p = subprocess.run([exe, "-arch=sm_90", "-c", "-v", "-o", str(Path(tmp) / "k.o"), str(src)],
                           capture_output=True, text=True, timeout=timeout)
    if p.returncode != 0:
        raise RuntimeError(f"ptxas failed:\n{p.stderr[-3000:]}")
    used = _PTXAS_USED.findall(p.stderr)
    spill = _PTXAS_SPILL.findall(p.stderr)
    if len(used) != 1:
        raise RuntimeError(f"ptxas reported {len(used)} kernels' registers:\n{p.stderr[-3000:]}")
    return {"registers": int(used[0]), "spill_bytes": sum(int(a) + int(b) for a, b in spill)}


_MEMORY_OP = re.compile(r"^\s*(?:@%p\d+\s+)?(?:ld|st|atom|red|cp\.async)\.(?!param|local)", re.M)
# what an early kernel may not do before its entry: write global memory (cp.async from global memory into its own
# shared memory, and that copy's commits and waits, are reads of weights)
_WRITE_OP = re.compile(r"^\s*(?:@%p\d+\s+)?(?:st|atom|red|cp\.async)\."
                       r"(?!param|local|shared|c[ag]\.shared|commit_group|wait_group)", re.M)


def entry_first(ptx, early=False):
    """Whether the kernel's PTX runs kernels.pdl's entry (the grid-dependency wait, then the trigger) before its
    first load, store or atomic (the entry block comes first in the text), parameter loads and a thread's own local
    memory aside (LLVM may zero a local array above the entry: no other thread or grid sees it). `early` (a kernel
    of a module's EARLY_READS, whose code above the entry reads weights only: tests/kernels/test_pdl.py): loads and
    its own shared memory (cp.async from global memory into it included) may come first, but no other store or
    atomic."""
    body = ptx[ptx.find(".entry"):]
    wait = body.find("griddepcontrol.wait;")
    trigger = body.find("griddepcontrol.launch_dependents;")
    first = (_WRITE_OP if early else _MEMORY_OP).search(body)
    return 0 <= wait < trigger and (first is None or trigger < first.start())


def all_kernels():
    """[(module name, kernel name, signature)] of every kernel listed in a SIGNATURES table, in a fixed order."""
    import kernels
    out = []
    for info in pkgutil.iter_modules(kernels.__path__):
        mod = importlib.import_module(f"kernels.{info.name}")
        out += [(info.name, kname, sig) for kname, sig in getattr(mod, "SIGNATURES", {}).items()]
    return out


def launch_bounds_of(fn):
    """The launch bounds a kernel's dispatcher was built with (`cuda.jit(launch_bounds=...)`), or None: the GPU
    compile of the engine passes them to ptxas, so the PTX made here must carry them too (.maxntid, .minnctapersm)."""
    return getattr(fn, "targetoptions", {}).get("launch_bounds")


def _ptx_of(numba_cuda, fn, sig):
    ptx, _ = numba_cuda.compile_ptx(fn.py_func, sig, cc=(9, 0), fastmath=False, launch_bounds=launch_bounds_of(fn))
    return ptx


def _compile_one(numba_cuda, mod_name, kname, sig, with_ptx=False):
    mod = importlib.import_module(f"kernels.{mod_name}")
    fn = getattr(mod, kname)
    early = fn.py_func.__name__ in getattr(mod, "EARLY_READS", {})
    try:
        ptx = _ptx_of(numba_cuda, fn, sig)
        ok = ".target sm_90" in ptx
        row = {"module": mod_name, "kernel": kname, "ok": ok, "ptx_bytes": len(ptx),
               "shfl": "shfl.sync" in ptx, "atom": "atom." in ptx, "mma": "mma.sync" in ptx,
               "entry_first": entry_first(ptx, early), "early": early}
        if with_ptx:
            row["ptx"] = ptx
        return row
    except Exception as e:   # noqa: BLE001 - reported to the test
        return {"module": mod_name, "kernel": kname, "ok": False, "error": f"{type(e).__name__}: {e}"}


def _serve():
    """Compile the "module:kernel" of each stdin line; answer each with one JSON line, PTX included."""
    numba_cuda = _compiler()
    sigs = {f"{m}:{k}": sig for m, k, sig in all_kernels()}
    for line in sys.stdin:
        name = line.strip()
        mod_name, kname = name.split(":")
        print(json.dumps(_compile_one(numba_cuda, mod_name, kname, sigs[name], with_ptx=True)), flush=True)
    return 0


def _heaviest_first(kernels):
    """Queue order for compile_all: modules with the most `@inline_device` functions first (their kernels are the
    largest once inlined and take the longest: q4k_gemv's decode kernels several seconds each on the dev box, most
    kernels ~1 s), so that the longest compiles start early and the children finish together."""
    def inlined(mod_name):
        return (ROOT / "kernels" / f"{mod_name}.py").read_text().count("@inline_device")
    return sorted(kernels, key=lambda mks: -inlined(mks[0]))         # stable: SIGNATURES order within a module


def compile_all(workers=2, timeout=1200):
    """Every kernel of every SIGNATURES table compiled for sm_90 by `workers` child processes (`--serve`) fed one
    kernel at a time from one queue: [one JSON row per kernel]. Rows that compiled also fill PTX_OF_SESSION."""
    import tempfile
    import time
    queue = [f"{m}:{k}" for m, k, _ in _heaviest_first(all_kernels())]
    errs = [tempfile.TemporaryFile("w+") for _ in range(workers)]      # a file, not a pipe: warnings never block
    procs = [subprocess.Popen([sys.executable, "-m", "tests.kernels.compile_sm90", "--serve"], cwd=ROOT,
                              env=_child_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err,
                              text=True, bufsize=1) for err in errs]
    sel = selectors.DefaultSelector()
    rows, busy, deadline = [], 0, time.monotonic() + timeout
    try:
        for p in procs:
            if queue:
                p.stdin.write(queue.pop(0) + "\n")
                p.stdin.flush()
                busy += 1
                sel.register(p.stdout, selectors.EVENT_READ, p)
            else:
                p.stdin.close()
        while busy:
            events = sel.select(timeout=max(1.0, deadline - time.monotonic()))
            if not events or time.monotonic() > deadline:
                raise TimeoutError(f"compile_all: {busy} children still compiling after {timeout} s")
            for key, _ in events:
                p, line = key.data, key.fileobj.readline()
                while line and not line.startswith("{"):      # anything else a library prints on stdout
                    line = key.fileobj.readline()
                if not line:                                  # the child died: its stderr goes to the test
                    err = errs[procs.index(p)]
                    err.seek(0)
                    raise RuntimeError(f"a compile child exited early:\n{err.read()[-3000:]}")
                rows.append(json.loads(line))
                busy -= 1
                if queue:
                    p.stdin.write(queue.pop(0) + "\n")
                    p.stdin.flush()
                    busy += 1
                else:
                    sel.unregister(p.stdout)
                    p.stdin.close()
        for p in procs:
            p.wait(timeout=60)
    finally:
        for p, err in zip(procs, errs):
            if p.poll() is None:
                p.kill()
                p.wait()
            err.close()
    for r in rows:
        if r["ok"]:
            PTX_OF_SESSION[f"{r['module']}:{r['kernel']}"] = r["ptx"]
    return rows, [p.returncode for p in procs]


def main():
    if len(sys.argv) == 3 and sys.argv[1] == "--ptx":
        return _ptx(sys.argv[2])
    if len(sys.argv) == 2 and sys.argv[1] == "--cache":
        return _cache_keys()
    if len(sys.argv) == 2 and sys.argv[1] == "--serve":
        return _serve()
    numba_cuda = _compiler()
    results = [_compile_one(numba_cuda, *mks) for mks in all_kernels()]
    for r in results:
        print(json.dumps(r))
    return 0 if results and all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    os.environ.pop("NUMBA_ENABLE_CUDASIM", None)    # only in this child process: the simulator cannot make PTX
    sys.exit(main())
