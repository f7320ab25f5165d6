"""Weights into L2 ahead of the kernel that reads them (docs/toolchain.md §4.9).

Owns `l2_prefetch`: one small launch that asks L2 for whole weight matrices (`cp.async.bulk.prefetch.L2.global`,
PTX ISA 8.0, sm_90, through `prefetch_l2_device`), issued on a stream beside a stretch of the step that leaves
DRAM bandwidth idle (the attention's score and value kernels, the MoE's latency-bound GEMVs), so that a later
latency-bound GEMV finds its weights in L2 instead of DRAM: a GEMV of the engine's took 10.0 us hot and 20.3 us
cold on the H200. A prefetch is a hint: it changes no value any load returns, and the weights are written only
before any step runs, so the bits stay those without it. Its kernel reads and writes nothing: each thread asks for
chunks of CHUNK bytes in turn, and exits without waiting for them.

Whether it pays depends on the L2 keeping the lines until their reader runs (50 MB on an H100; what else streams
through L2 in between evicts them): the CUDA backend leaves it off unless asked (CudaBackend.l2_prefetch).
The simulator has no L2: its prefetch does nothing.
"""
import numpy as np
from numba import cuda
from numba.cuda.core import config as _cuda_config

from kernels import bounded_jit, inline_device, on_bytes
from kernels.pdl import grid_entry_device

__all__ = ["l2_prefetch", "l2_prefetch_kernel", "prefetch_l2_device", "PREFETCH_PTX", "SIGNATURES"]

SIM = bool(_cuda_config.ENABLE_CUDASIM)
PREFETCH_PTX = "cp.async.bulk.prefetch.L2.global"
ALIGN = 16                    # the instruction's address and size granularity (bytes)
CHUNK = 1 << 16               # bytes a prefetch asks for
THREADS = 128
BLOCKS = 8                    # a few SMs' worth: the instructions only start the copies


if SIM:
    @cuda.jit(device=True)
    def prefetch_l2_device(ary, i, nbytes):
        """The simulator has no L2: nothing to ask for."""
        return
else:
    from llvmlite import ir as _ir
    from numba.core import types as _types
    from numba.core.extending import intrinsic as _intrinsic

    @_intrinsic
    def _prefetch_l2(typingctx, ary, i, nbytes):
        """`cp.async.bulk.prefetch.L2.global [g], n` with g the global address of element i of the 1-D array ary
        (its generic address converted) and n bytes: volatile inline assembly without a memory clobber (it reads
        and writes nothing the kernel sees)."""
        if ary.ndim != 1:
            return None
        sig = _types.void(ary, _types.int64, _types.uint32)

        def codegen(context, builder, signature, args):
            arr = context.make_array(signature.args[0])(context, builder, args[0])
            addr = builder.ptrtoint(builder.gep(arr.data, [args[1]]), _ir.IntType(64))
            fnty = _ir.FunctionType(_ir.VoidType(), [_ir.IntType(64), _ir.IntType(32)])
            asm = _ir.InlineAsm(fnty, "{ .reg .u64 g; cvta.to.global.u64 g, $0; " + PREFETCH_PTX + " [g], $1; }",
                                "l,r", side_effect=True)
            builder.call(asm, [addr, args[2]])
            return context.get_dummy_value()
        return sig, codegen

    @inline_device
    def prefetch_l2_device(ary, i, nbytes):
        """Ask L2 for `nbytes` of the 1-D global array `ary` from element i. The address must lie on ALIGN bytes and
        nbytes be a positive multiple of ALIGN below 2^32; nothing is checked here (`l2_prefetch` does)."""
        _prefetch_l2(ary, np.int64(i), np.uint32(nbytes))


@bounded_jit(THREADS)
def l2_prefetch_kernel(a0, n0, a1, n1):
    """Ask L2 for the first n0 bytes of a0 and the first n1 bytes of a1 (uint8, 1-D; n1 may be 0): the grid's
    threads take the CHUNK-byte pieces of a0, then of a1, in turn."""
    grid_entry_device()
    j = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    step = cuda.gridDim.x * cuda.blockDim.x
    k0 = (n0 + CHUNK - 1) // CHUNK
    k = j
    while k < k0 + (n1 + CHUNK - 1) // CHUNK:
        if k < k0:
            off = k * CHUNK
            prefetch_l2_device(a0, off, min(CHUNK, n0 - off))
        else:
            off = (k - k0) * CHUNK
            prefetch_l2_device(a1, off, min(CHUNK, n1 - off))
        k += step


SIGNATURES = {"l2_prefetch_kernel": "void(uint8[::1], int64, uint8[::1], int64)"}


def _flat(w):
    if w.dtype != np.uint8:
        raise ValueError(f"l2_prefetch: weights must be uint8 (their file bytes), got {w.dtype}")
    if not w.is_c_contiguous():
        raise ValueError(f"l2_prefetch: weights must be C-contiguous, got strides {w.strides}")
    flat = w.reshape(w.size)
    if w.size % ALIGN or not on_bytes(flat, ALIGN):
        raise ValueError(f"l2_prefetch: {w.size} bytes at an address that is not on {ALIGN} bytes")
    return flat


def l2_prefetch(weights, stream=0):
    """Ask L2 for one or two whole weight arrays (device, uint8, C-contiguous, sizes and addresses on 16 bytes) in
    one launch on `stream`; returns nothing and changes nothing."""
    if not 1 <= len(weights) <= 2:
        raise ValueError(f"l2_prefetch: one or two arrays, got {len(weights)}")
    flats = [_flat(w) for w in weights]
    if len(flats) == 1:
        flats.append(flats[0])
        sizes = (flats[0].size, 0)
    else:
        sizes = (flats[0].size, flats[1].size)
    l2_prefetch_kernel[BLOCKS, THREADS, stream](flats[0], sizes[0], flats[1], sizes[1])
