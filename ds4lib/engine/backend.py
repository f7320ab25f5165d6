"""Backend table: `cpu` runs the reference forward (NumPy) over the dequantised stack; `cuda` runs Numba CUDA
kernels (backend_cuda.py, the only ds4lib module that imports `kernels`). Both expose the same methods:
new_state(), forward(state, tokens, last_only, observer) -> ForwardOut (logits [T, V] where the backend keeps
them), to_host(logits) -> numpy, sample(logits_row, params, seed, step, mask=None) -> int (the CUDA backend samples
on the device; `mask` is a constrained step's int32 token bitmask, ds4lib.ref.sampling), memory_plan() ->
MemoryPlan, and `name`.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass

__all__ = ["make_backend", "BACKENDS", "BackendContext"]

BACKENDS = {"cpu": "ds4lib.engine.backend_cpu:CpuBackend", "cuda": "ds4lib.engine.backend_cuda:CudaBackend"}


@dataclass
class BackendContext:
    """What a backend needs from the engine that owns it: the model config, the base file (None when a backend is
    given its weights directly, as the real-size benchmark does), the Engram token map and table reader (None
    without Engram layers), the prefill block, the context length, and whether speculative decoding may use the
    DSpark draft stages (False: a backend may leave them out, as the CUDA backend does: no stage weights on the
    device, no context features computed)."""
    cfg: object
    base: object
    token_map: object
    engram_reader: object
    prefill_block: int
    context_length: int
    dspark: bool = True


def make_backend(name: str, engine, gains, bias):
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}; choose one of {', '.join(BACKENDS)}")
    mod, cls = BACKENDS[name].split(":")
    return getattr(importlib.import_module(mod), cls)(engine, gains, bias)
