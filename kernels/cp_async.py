"""Asynchronous copies from global to shared memory (`cp.async`, PTX ISA 7.0, sm_80 and later; docs/toolchain.md).

Owns:
- `cp_async16_device(dst, di, src, si)`: start copying the 16 bytes at element si of the 1-D global array `src` to
  element di of the 1-D shared array `dst` (`cp.async.cg.shared.global`, cached in L2 only). The copy does not pass
  through registers, so a thread can keep many of them in flight without holding their data (kernels.q4k_gemv's
  weight rings; measured and off by default there, BENCHMARKS.md issue 12). Both addresses must
  lie on 16 bytes; nothing is checked here (the callers' layouts guarantee it).
- `cp_async_commit_device()`: closes the thread's copies issued since the last commit into one group.
- `cp_async_wait_device(n)`: waits until at most n (a compile-time constant, 0 <= n <= MAX_WAIT: a literal or a
  kernel factory's closure integer) of the thread's committed groups are still in flight; the copies of the older
  groups are then in shared memory, visible to this thread. Other threads see them after a barrier (`cuda.syncwarp`
  inside a warp). A kernel names it as a global, so its on-disk cache key (closure values) holds only n.
The inline assembly of the wait has a memory clobber, so the compiler keeps shared-memory reads after it. Each PTX
instruction sits on a line of its own, where tests/kernels/compile_sm90.py's checks of what precedes a kernel's grid
entry look for memory operations.

The simulator has no asynchronous copies: its `cp_async16_device` copies the two 8-byte words at once (uint64
arrays) and commit and wait do nothing, which is what the hardware's results look like after the wait.
"""
import numpy as np
from numba import cuda
from numba.cuda.core import config as _cuda_config

from kernels import inline_device

__all__ = ["cp_async16_device", "cp_async_commit_device", "cp_async_wait_device", "MAX_WAIT"]

SIM = bool(_cuda_config.ENABLE_CUDASIM)
MAX_WAIT = 7                  # the largest group count the wait functions are made for

if SIM:
    @cuda.jit(device=True)
    def cp_async16_device(dst, di, src, si):
        """dst[di], dst[di + 1] = src[si], src[si + 1] (uint64 arrays; the simulator copies at once)."""
        dst[di] = src[si]
        dst[di + 1] = src[si + 1]

    @cuda.jit(device=True)
    def cp_async_commit_device():
        """Nothing to group in the simulator."""
        return

    @cuda.jit(device=True)
    def cp_async_wait_device(n):
        """The simulator's wait: its copies are already done (n is still held to the instruction's range)."""
        if not 0 <= n <= MAX_WAIT:
            raise ValueError("cp_async_wait_device: n outside [0, MAX_WAIT]")
else:
    from llvmlite import ir as _ir
    from numba.core import types as _types
    from numba.core.extending import intrinsic as _intrinsic

    _I64 = _ir.IntType(64)

    @_intrinsic
    def _cp_async16(typingctx, dst, di, src, si):
        """`cp.async.cg.shared.global [s], [g], 16` with s the shared-window address of element di of dst (a shared
        array, whose data pointer Numba keeps generic) and g the global address of element si of src."""
        if dst.ndim != 1 or src.ndim != 1:
            return None
        sig = _types.void(dst, _types.uint64, src, _types.uint64)

        def codegen(context, builder, signature, args):
            d = context.make_array(signature.args[0])(context, builder, args[0])
            s = context.make_array(signature.args[2])(context, builder, args[2])
            da = builder.ptrtoint(builder.gep(d.data, [args[1]]), _I64)
            sa = builder.ptrtoint(builder.gep(s.data, [args[3]]), _I64)
            fnty = _ir.FunctionType(_ir.VoidType(), [_I64, _I64])
            asm = _ir.InlineAsm(fnty, "{\n\t.reg .u64 s64, g;\n\t.reg .u32 s;\n\tcvta.to.shared.u64 s64, $0;\n\t"
                                      "cvt.u32.u64 s, s64;\n\tcvta.to.global.u64 g, $1;\n\t"
                                      "cp.async.cg.shared.global [s], [g], 16;\n\t}",
                                "l,l,~{memory}", side_effect=True)
            builder.call(asm, [da, sa])
            return context.get_dummy_value()
        return sig, codegen

    @inline_device
    def cp_async16_device(dst, di, src, si):
        """Start the 16-byte copy src[si:si+2] -> dst[di:di+2] (uint64 elements; module docstring)."""
        _cp_async16(dst, np.uint64(di), src, np.uint64(si))

    @_intrinsic
    def _commit(typingctx):
        sig = _types.void()

        def codegen(context, builder, signature, args):
            fnty = _ir.FunctionType(_ir.VoidType(), [])
            builder.call(_ir.InlineAsm(fnty, "cp.async.commit_group;", "~{memory}", side_effect=True), [])
            return context.get_dummy_value()
        return sig, codegen

    @inline_device
    def cp_async_commit_device():
        """Close this thread's copies issued since the last commit into one group."""
        _commit()

    @_intrinsic(prefer_literal=True)
    def cp_async_wait_device(typingctx, n):
        """`cp.async.wait_group n`: wait until at most n (a compile-time integer in [0, MAX_WAIT], typed as a literal)
        of this thread's groups are in flight."""
        if not isinstance(n, _types.IntegerLiteral) or not 0 <= n.literal_value <= MAX_WAIT:
            return None
        sig = _types.void(n)
        text = f"cp.async.wait_group {int(n.literal_value)};"

        def codegen(context, builder, signature, args):
            fnty = _ir.FunctionType(_ir.VoidType(), [])
            builder.call(_ir.InlineAsm(fnty, text, "~{memory}", side_effect=True), [])
            return context.get_dummy_value()
        return sig, codegen
