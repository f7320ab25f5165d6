"""The simulator shim's block scheduler (tests/kernels/cudasim_shim.py, installed by tests/kernels/conftest.py): one
simulated thread at a time in thread-id order between barriers, a barrier that waits only for the threads still
running, and an exception raised by the launch, named by its thread, that stops the block's other threads. Simulator
only: a GPU promises no order. And its device calls (fast_device_calls): a callee reads the simulated `cuda`."""
import numpy as np
import pytest
from numba import cuda

import tests.kernels.shim_calls_helper as helper
from tests.kernels.shim_calls_helper import sum_device

pytestmark = pytest.mark.simulator                 # tests the CUDA simulator's shim


@cuda.jit
def _order_kernel(log, n):
    tid = cuda.threadIdx.x
    log[cuda.atomic.add(n, 0, 1)] = tid
    if tid % 2 == 0:
        return                                  # exited: the barrier below no longer waits for this thread
    cuda.syncthreads()
    log[cuda.atomic.add(n, 0, 1)] = 100 + tid
    cuda.syncthreads()
    log[cuda.atomic.add(n, 0, 1)] = 200 + tid


@cuda.jit
def _fail_kernel(out):
    tid = cuda.threadIdx.x
    if tid == 3:
        raise ValueError("boom")
    cuda.syncthreads()
    out[tid] = 1


def test_threads_run_in_id_order_between_barriers():
    log = np.full(16, -1, np.int64)
    n = np.zeros(1, np.int64)
    _order_kernel[1, 8](log, n)
    assert list(log) == list(range(8)) + [101, 103, 105, 107, 201, 203, 205, 207]


def test_an_exception_names_its_thread_and_stops_the_block():
    out = np.zeros(8, np.int64)
    with pytest.raises(ValueError, match=r"tid=\[3, 0, 0\] ctaid=\[0, 0, 0\]: boom"):
        _fail_kernel[1, 8](out)
    assert not out.any()                        # 0-2 abort at the barrier, 4-7 never start


@cuda.jit
def _cross_module_kernel(out):
    out[cuda.threadIdx.x] = sum_device(2000)


def test_device_calls_into_another_module_see_the_simulated_cuda():
    """fast_device_calls: a device function that reads `cuda`, directly or through a plain helper of its module,
    gets the launch's simulated module, whether its module is swapped by its own kernel's launch (first here, where
    the shim first meets the module) or by the call from another module's kernel; afterwards the module's `cuda` is
    numba's again."""
    real = helper.cuda
    lanes = np.arange(40) % 32
    out = np.zeros(40, np.int64)
    helper.module_kernel[1, 40](out)
    np.testing.assert_array_equal(out, 1000 + 101 * lanes)
    assert helper.cuda is real
    out[:] = 0
    _cross_module_kernel[1, 40](out)
    np.testing.assert_array_equal(out, 2000 + 101 * lanes)
    assert helper.cuda is real
