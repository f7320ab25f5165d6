"""The last-block ticket: each block of a grid writes its part to global memory, and the block that draws the last
ticket from a device counter reads every part and finishes (kernels.hc.hc_mix_fused_kernel, kernels.moe's
route_gemv_kernel, the split rows of kernels.q4k_gemv's tensor-core kernel).

Owns `take_ticket_device(counter, i)`: counter[i] += 1, returning the old value, as one atomic with acquire-release
semantics at GPU scope (PTX `atom.acq_rel.gpu.add.u32`, generic address). The pattern that uses it:
1. every thread of the block stores its part;
2. a block barrier (`cuda.syncthreads`);
3. thread 0 takes the ticket and tells the block, through shared memory, whether it was the last one;
4. a block barrier; the last block's threads then load every block's part.
The atomic's release half orders the block's stores, which the barrier has put before it, ahead of the ticket. Its
acquire half orders the other blocks' stores, which their tickets carried, ahead of the loads that the second barrier
puts after it. Release and acquire are cumulative in the PTX memory model, and the barriers extend them to the other
threads of the block. This is the split-K "semaphore" of the CUDA libraries: a barrier, then one thread's release, and
one thread's acquire, then a barrier.

`last_block_device(counter, i, n)` is steps 2-4 for a counter that n blocks draw once each in a launch: the last one
also puts it back to zero at once (no other block touches it afterwards), so a captured graph replays it and eager
calls follow.

It replaces a `cuda.threadfence()` (PTX membar.gl, i.e. `fence.sc.gpu`, SASS MEMBAR.SC.GPU) by every thread before
the barrier and again after it. The PTX ISA calls the sequentially consistent fence the slower one, and
`fence.acq_rel` sufficient for release/acquire synchronization. The atomic also carries one fence for the block (thread
0's), not one a warp. In the SASS (sm_90) the acquire still invalidates the SM's L1 (CCTL.IVALL), so the last
block's plain loads cannot hit stale lines.

The simulator has no inline PTX and no weak memory to order: there the ticket is `cuda.atomic.add`.
"""
import numpy as np
from numba import cuda
from numba.cuda.core import config as _cuda_config

from kernels import inline_device

__all__ = ["take_ticket_device", "last_block_device", "TICKET_PTX"]

TICKET_PTX = "atom.acq_rel.gpu.add.u32"

if _cuda_config.ENABLE_CUDASIM:
    @cuda.jit(device=True)
    def take_ticket_device(counter, i):
        """counter[i] += 1 (int32 [n]); the old value."""
        return cuda.atomic.add(counter, i, 1)
else:
    from llvmlite import ir as _ir
    from numba.core import types as _types
    from numba.core.extending import intrinsic as _intrinsic

    @_intrinsic
    def _ticket(typingctx, ary, i):
        """counter[i] += 1 by one acquire-release atomic at GPU scope; the old value (int32 [n] counter)."""
        if ary.ndim != 1 or ary.dtype != _types.int32:
            return None
        sig = _types.int32(ary, _types.int64)

        def codegen(context, builder, signature, args):
            arr = context.make_array(signature.args[0])(context, builder, args[0])
            addr = builder.ptrtoint(builder.gep(arr.data, [args[1]]), _ir.IntType(64))
            i32 = _ir.IntType(32)
            asm = _ir.InlineAsm(_ir.FunctionType(i32, [_ir.IntType(64)]), TICKET_PTX + " $0, [$1], 1;",
                                "=r,l,~{memory}", side_effect=True)
            return builder.call(asm, [addr])
        return sig, codegen

    @inline_device
    def take_ticket_device(counter, i):
        """counter[i] += 1 (int32 [n]); the old value. The block's stores before a barrier are released by it; the
        stores that earlier tickets released are visible after it, to every thread past the next barrier."""
        return _ticket(counter, np.int64(i))


@inline_device
def last_block_device(counter, i, n):
    """Steps 2-4 of the pattern (module docstring), after the block's stores: a barrier, thread 0's ticket from
    counter[i] (n blocks draw it in this launch; the last puts it back to zero), a barrier. True in every thread of
    the block that drew the last ticket (block-uniform). Every thread of the block must call it."""
    last = cuda.shared.array(1, np.int32)
    cuda.syncthreads()
    if cuda.threadIdx.x == 0:
        ticket = take_ticket_device(counter, i)
        last[0] = 1 if ticket == n - 1 else 0
        if ticket == n - 1:
            counter[i] = 0                       # every block has drawn: no other access in this launch
    cuda.syncthreads()
    return last[0] == 1
