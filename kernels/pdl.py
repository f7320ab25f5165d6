"""Programmatic dependent launch (sm_90): the entry every kernel of `kernels/` runs first (docs/toolchain.md §4.8).

Owns `grid_entry_device()`: `griddepcontrol.wait` then `griddepcontrol.launch_dependents` (PTX ISA 7.8, sm_90), and
`prefetch_l2_device()`, the one thing a kernel may do before it: ask L2 for bytes of an array that no grid writes
(weights), `cp.async.bulk.prefetch.L2.global` (PTX ISA 8.0, sm_90).
- The wait returns once every grid this one depends on through a programmatic graph edge has completed and its
  memory operations are visible; for a kernel launched with ordinary dependencies (eager launches, a default graph
  edge) it returns at once. Every kernel calls it before it touches global memory, so a kernel whose blocks start
  early reads and writes nothing before its predecessor is done: the same bits as without the edge.
- The trigger after it lets the grids that depend on this one through such an edge be launched once every block of
  this grid has passed its own wait (or exited), so that their blocks are resident and waiting, not yet launched,
  when this grid completes. Placed after the wait, it keeps at most one grid of a chain launched ahead: a grid
  whose blocks wait never lets its successor launch.
- A prefetch is a hint (it never changes what a load returns), and weights are written only before any step runs, so
  a GEMV can prefetch its own weight slice before the wait: while its blocks sit resident behind the predecessor, the
  slice streams into L2, and its loads after the wait hit L2 instead of starting DRAM round trips (docs/toolchain.md
  §4.8).
The CUDA backend's captured graphs turn their kernel-to-kernel edges into programmatic ones
(ds4lib.engine.cuda_graph, DS4_CUDA_PDL); that is what removes the launch latency between dependent kernels.
The simulator has no grid dependencies and no L2: its entry and its prefetch do nothing.
Does not own: the graph edges (ds4lib.engine.cuda_graph).
"""
import numpy as np
from numba import cuda
from numba.cuda.core import config as _cuda_config

__all__ = ["grid_entry_device", "prefetch_l2_device", "ENTRY_PTX", "PREFETCH_PTX"]

SIM = bool(_cuda_config.ENABLE_CUDASIM)
ENTRY_PTX = ("griddepcontrol.wait;", "griddepcontrol.launch_dependents;")
PREFETCH_PTX = "cp.async.bulk.prefetch.L2.global"

if SIM:
    @cuda.jit(device=True)
    def grid_entry_device():
        """The simulator's entry: no grid dependencies there."""
        return

    @cuda.jit(device=True)
    def prefetch_l2_device(ary, i, nbytes):
        """The simulator has no L2: nothing to ask for."""
        return
else:
    from llvmlite import ir as _ir
    from numba.core import types as _types
    from numba.core.extending import intrinsic as _intrinsic

    @_intrinsic
    def _grid_entry(typingctx):
        """The two instructions as one volatile inline assembly with a memory clobber: no load or store moves above
        it."""
        sig = _types.void()

        def codegen(context, builder, signature, args):
            fnty = _ir.FunctionType(_ir.VoidType(), [])
            asm = _ir.InlineAsm(fnty, "\n\t".join(ENTRY_PTX), "~{memory}", side_effect=True)
            builder.call(asm, [])
            return context.get_dummy_value()
        return sig, codegen

    @cuda.jit(device=True, inline=True)
    def grid_entry_device():
        """Wait for the grids this one depends on programmatically, then let its own dependents launch."""
        _grid_entry()

    @_intrinsic
    def _prefetch_l2(typingctx, ary, i, nbytes):
        """`cp.async.bulk.prefetch.L2.global [a], n` for the address a of element i of a 1-D array (converted from
        generic to global) and n bytes, as volatile inline assembly without a memory clobber (it reads nothing the
        kernel sees)."""
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

    @cuda.jit(device=True, inline=True)
    def prefetch_l2_device(ary, i, nbytes):
        """Ask L2 for `nbytes` of global array `ary` from element i. The address must be 16-byte aligned and nbytes a
        positive multiple of 16 below 2^32; nothing is checked. Only for data that no grid of the step writes (the
        weights): a kernel calls it before its `grid_entry_device()`."""
        _prefetch_l2(ary, np.int64(i), np.uint32(nbytes))
