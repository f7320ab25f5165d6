"""Compile every kernel of `kernels/` for sm_90 without a GPU and print one JSON line per kernel.

Run in its own process (the simulator cannot compile PTX): `python -m tests.kernels.compile_sm90`.
Each kernel module lists `SIGNATURES` {kernel name: Numba signature}.
"""
import importlib
import json
import os
import pkgutil
import sys

os.environ.pop("NUMBA_ENABLE_CUDASIM", None)


class _FakeDevice:
    compute_capability = (9, 0)
    id = 0
    name = b"sm_90 (no device)"


def main():
    import numba.cuda
    import numba.cuda.dispatcher as disp
    disp.get_current_device = lambda: _FakeDevice()   # device functions resolve their target without a driver
    import kernels
    results = []
    for info in pkgutil.iter_modules(kernels.__path__):
        mod = importlib.import_module(f"kernels.{info.name}")
        for kname, sig in getattr(mod, "SIGNATURES", {}).items():
            fn = getattr(mod, kname)
            try:
                ptx, _ = numba.cuda.compile_ptx(fn.py_func, sig, cc=(9, 0), fastmath=False)
                ok = ".target sm_90" in ptx
                results.append({"module": info.name, "kernel": kname, "ok": ok, "ptx_bytes": len(ptx),
                                "shfl": "shfl.sync" in ptx, "atom": "atom." in ptx, "mma": "mma.sync" in ptx})
            except Exception as e:   # noqa: BLE001 - reported to the test
                results.append({"module": info.name, "kernel": kname, "ok": False, "error": f"{type(e).__name__}: {e}"})
    for r in results:
        print(json.dumps(r))
    return 0 if results and all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
