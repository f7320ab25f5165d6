"""Warp intrinsics for Numba's CUDA simulator, which has none (docs/toolchain.md §2.3).

Each call publishes the lane's value in a per-block table keyed by thread id, waits at a block barrier,
reads the source lane, and waits again. Semantics therefore need every live thread of the block to
reach the call, which holds for the warp-synchronous kernels of this project.
"""
import sys
import threading
import traceback

import numpy as np

_installed = False


def _thread():
    return threading.current_thread()


def _exchange(value):
    t = _thread()
    table = t._manager.__dict__.setdefault("_warp_table", {})
    table[t.thread_id] = value
    t.syncthreads()
    return t, table


def _finish(t):
    t.syncthreads()


def _lane_value(t, table, src_lane, own):
    warp_base = (t.thread_id // 32) * 32
    src = warp_base + src_lane
    return table.get(src, own)


def shfl_sync(mask, value, src_lane):
    t, table = _exchange(value)
    out = _lane_value(t, table, int(src_lane) % 32, value)
    _finish(t)
    return out


def shfl_up_sync(mask, value, delta):
    t, table = _exchange(value)
    lane = t.thread_id % 32
    out = _lane_value(t, table, lane - delta, value) if lane - delta >= 0 else value
    _finish(t)
    return out


def shfl_down_sync(mask, value, delta):
    t, table = _exchange(value)
    lane = t.thread_id % 32
    out = _lane_value(t, table, lane + delta, value) if lane + delta < 32 else value
    _finish(t)
    return out


def shfl_xor_sync(mask, value, lane_mask):
    t, table = _exchange(value)
    lane = t.thread_id % 32
    out = _lane_value(t, table, lane ^ lane_mask, value)
    _finish(t)
    return out


def ballot_sync(mask, predicate):
    t, table = _exchange(bool(predicate))
    base = (t.thread_id // 32) * 32
    out = 0
    for lane in range(32):
        if table.get(base + lane, False):
            out |= 1 << lane
    _finish(t)
    return out


def all_sync(mask, predicate):
    return int(ballot_sync(mask, predicate) == _live_mask())


def any_sync(mask, predicate):
    return int(ballot_sync(mask, predicate) != 0)


def _live_mask():
    t = _thread()
    bd = t._manager._block_dim
    n = bd[0] * bd[1] * bd[2]
    base = (t.thread_id // 32) * 32
    return (1 << min(32, n - base)) - 1


def syncwarp(mask=0xFFFFFFFF):
    _thread().syncthreads()


def activemask():
    return _live_mask()


def lock_simulator_shared_arrays():
    """Work around a data race in numba-cuda 0.30.4's simulator: FakeCUDAShared.array looks up and creates a
    block's shared array without a lock, so two threads of a launch's first block can receive *different*
    arrays (seen as random wrong results with sys.setswitchinterval(1e-4)). This replaces it with the same
    code under a lock. Installed by install()."""
    from numba.core import types
    from numba.cuda.simulator import kernelapi
    from numba.np import numpy_support
    if getattr(kernelapi.FakeCUDAShared, "_ds4_locked", False):
        return
    lock = threading.Lock()

    def array(self, shape, dtype, alignment=None):
        if alignment is not None:
            raise RuntimeError("Array alignment is not supported in cudasim")
        if isinstance(dtype, types.Type):
            dtype = numpy_support.as_dtype(dtype)
        if shape == 0:
            count = self._dynshared_size // dtype.itemsize
            return np.frombuffer(self._dynshared.data, dtype=dtype, count=count)
        caller = traceback.extract_stack(sys._getframe())[-2][0:2]      # allocations are keyed by call site
        with lock:
            res = self._allocations.get(caller)
            if res is None:
                res = np.empty(shape, dtype)
                self._allocations[caller] = res
        return res

    kernelapi.FakeCUDAShared.array = array
    kernelapi.FakeCUDAShared._ds4_locked = True


def install():
    global _installed
    if _installed:
        return
    from numba.cuda.simulator import kernelapi
    for name in ("shfl_sync", "shfl_up_sync", "shfl_down_sync", "shfl_xor_sync", "ballot_sync", "all_sync",
                 "any_sync", "syncwarp", "activemask"):
        setattr(kernelapi.FakeCUDAModule, name, staticmethod(globals()[name]))
    lock_simulator_shared_arrays()
    _installed = True
