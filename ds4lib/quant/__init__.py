"""Quantizer orchestration: the ds4 base file (① base, docs/design.md §2) from an official-format checkpoint.

`quantize_checkpoint` (ds4 quantize, notebooks/quantize.ipynb) streams one layer at a time: VQ routed experts
(ds4lib.quant.vq_layer over ds4lib.solvers.vq, CPU or CUDA backend), q4_K linears, everything else as stored,
into the GGUF of ds4lib.formats.gguf. ds4lib.quant.measure holds the measurements the notebook reports.

Names are resolved lazily, so `ds4lib.quant.cuda_backend` imports on a machine without gguf or tqdm (the GPU
image, where bench/bench_lloyd.py runs).
"""
import importlib

_EXPORTS = {
    "DEFAULT_ROUNDS": "base_file", "QuantReport": "base_file", "file_sha256": "base_file",
    "layer_rows": "base_file", "quantize_checkpoint": "base_file", "verify_base": "base_file",
    "VerifyReport": "base_file",
    "DEVICES": "cuda_backend", "make_backend": "cuda_backend", "CudaLloyd": "cuda_backend",
    "bitwidth_curve": "measure", "default_layers": "measure", "file_errors": "measure",
    "shared_vs_per_expert": "measure",
    "BitPlan": "plan", "default_n13": "plan", "format_size_table": "plan", "parse_bits_plan": "plan",
    "size_table": "plan",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name):
    mod = _EXPORTS.get(name)
    if mod is None:
        raise AttributeError(f"module 'ds4lib.quant' has no attribute {name!r}")
    return getattr(importlib.import_module(f"ds4lib.quant.{mod}"), name)
