"""Device functions for tests/kernels/test_cudasim_shim.py's device-call tests, in a module of their own: a call from
a kernel of another module has to swap this module's `cuda` for the simulator's (cudasim_shim.fast_device_calls)."""
import numpy as np
from numba import cuda


def _plain_lane():
    """A plain Python helper that reads `cuda` (a simulator-only helper of a device function)."""
    return cuda.threadIdx.x % 32


@cuda.jit(device=True)
def lane_device():
    """Reads `cuda` itself."""
    return cuda.threadIdx.x % 32


@cuda.jit(device=True)
def plain_lane_device():
    """Never names `cuda`, but its plain helper reads it."""
    return _plain_lane()


@cuda.jit(device=True)
def sum_device(x):
    """Never reads `cuda`; its callee does."""
    return np.int64(x) + np.int64(lane_device()) + 100 * np.int64(plain_lane_device())


@cuda.jit
def module_kernel(out):
    """A kernel of this module: its launch swaps the module while the device calls below run."""
    out[cuda.threadIdx.x] = sum_device(1000)
