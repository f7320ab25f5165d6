"""Device operands filled with one 32-bit pattern, to a launcher's (shape, dtype) specification (e.g.
kernels.vq_gemv.stage_shapes, kernels.im_operand.im_stage_shapes): a test that checks what a kernel writes starts from
a pattern the kernel never writes, so that a word it skipped shows."""
import numpy as np


def filled(cuda, specs, fill):
    """One device array per (shape, dtype) of specs (32-bit dtypes), every word `fill`."""
    return tuple(cuda.to_device(np.full(sh, fill, np.uint32).view(dt)) for sh, dt in specs)
