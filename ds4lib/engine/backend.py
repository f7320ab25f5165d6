"""Backend table: `cpu` runs the reference forward (NumPy) over the dequantised stack; `cuda` runs Numba CUDA
kernels (backend_cuda.py, the only ds4lib module that imports `kernels`). Both expose the same methods:
new_state(), forward(state, tokens, last_only, observer) -> ForwardOut (logits [T, V] where the backend keeps
them), to_host(logits) -> numpy, sample(logits_row, params, seed, step, mask=None) -> int (the CUDA backend samples
on the device; `mask` is a constrained step's int32 token bitmask, ds4lib.ref.sampling), memory_plan() ->
MemoryPlan, and `name`.
"""
from __future__ import annotations

import importlib

__all__ = ["make_backend", "BACKENDS"]

BACKENDS = {"cpu": "ds4lib.engine.backend_cpu:CpuBackend", "cuda": "ds4lib.engine.backend_cuda:CudaBackend"}


def make_backend(name: str, engine, gains, bias):
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}; choose one of {', '.join(BACKENDS)}")
    mod, cls = BACKENDS[name].split(":")
    return getattr(importlib.import_module(mod), cls)(engine, gains, bias)
