"""Programmatic dependent launch (sm_90): the entry every kernel of `kernels/` runs first (docs/toolchain.md §4.8).

Owns `grid_entry_device()`: `griddepcontrol.wait` then `griddepcontrol.launch_dependents` (PTX ISA 7.8, sm_90).
- The wait returns once every grid this one depends on through a programmatic graph edge has completed and its
  memory operations are visible; for a kernel launched with ordinary dependencies (eager launches, a default graph
  edge) it returns at once. Every kernel calls it before it touches global memory, so a kernel whose blocks start
  early reads and writes nothing before its predecessor is done: the same bits as without the edge. The one
  exception is data no kernel of a step ever writes: the q4_K tensor-core GEMVs load their first weight words and
  the VQ GEMV stages its codebook before the entry, so those reads overlap the predecessor's last blocks (−0.07 to
  −0.10 ms a V4.1 token at 1k on an H100). A module lists such kernels in `EARLY_READS` {kernel: the parameters its
  code before the entry may use}; tests/kernels/test_pdl.py holds that code to them, and the PTX test to no store
  or atomic to global memory before the wait.
- The trigger after it lets the grids that depend on this one through such an edge be launched once every block of
  this grid has passed its own wait (or exited), so that their blocks are resident and waiting, not yet launched,
  when this grid completes. Placed after the wait, it keeps at most one grid of a chain launched ahead: a grid
  whose blocks wait never lets its successor launch.
The CUDA backend's captured graphs turn their kernel-to-kernel edges into programmatic ones
(ds4lib.engine.cuda_graph, DS4_CUDA_PDL); that is what removes the launch latency between dependent kernels.
The simulator has no grid dependencies: its entry does nothing.
Does not own: the graph edges (ds4lib.engine.cuda_graph).
"""
from numba import cuda
from numba.cuda.core import config as _cuda_config

from kernels import inline_device

__all__ = ["grid_entry_device", "ENTRY_PTX"]

SIM = bool(_cuda_config.ENABLE_CUDASIM)
ENTRY_PTX = ("griddepcontrol.wait;", "griddepcontrol.launch_dependents;")

if SIM:
    @cuda.jit(device=True)
    def grid_entry_device():
        """The simulator's entry: no grid dependencies there."""
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

    @inline_device
    def grid_entry_device():
        """Wait for the grids this one depends on programmatically, then let its own dependents launch."""
        _grid_entry()
