"""kernels/cp_async.py: 16-byte copies from global to shared memory in groups, waited for."""
import numpy as np
from numba import cuda                  # the simulator swaps this global inside kernels (conftest chose the mode)

from kernels.cp_async import cp_async16_device, cp_async_commit_device, cp_async_wait_device
from tests.kernels.conftest import SIMULATOR

GROUPS = 3
PENDING = GROUPS - 1                    # a global: the wait's count is typed as a literal
SH_WORDS = 2 * 32 * GROUPS
ALIGN = None if SIMULATOR else 16       # cp.async's destinations lie on 16 bytes


@cuda.jit
def _groups_kernel(src, out):
    """Each of 32 threads copies piece (lane + 32 g) of src in group g (three groups), reads group 0 back after
    waiting with two groups in flight and the rest after waiting for all; a lane reads its neighbour's pieces
    (copied by another thread), so the warp barrier is what makes them visible."""
    sh = cuda.shared.array(SH_WORDS, np.uint64, alignment=ALIGN)
    lane = cuda.threadIdx.x
    for g in range(GROUPS):
        j = lane + 32 * g
        cp_async16_device(sh, 2 * (32 * GROUPS - 1 - j), src, 2 * j)      # stored in reverse piece order
        cp_async_commit_device()
    cp_async_wait_device(PENDING)
    cuda.syncwarp(0xFFFFFFFF)
    other = (lane + 1) % 32
    k = 2 * (32 * GROUPS - 1 - other)
    out[2 * other] = sh[k]
    out[2 * other + 1] = sh[k + 1]
    cp_async_wait_device(0)
    cuda.syncwarp(0xFFFFFFFF)
    for g in range(1, GROUPS):
        j = other + 32 * g
        k = 2 * (32 * GROUPS - 1 - j)
        out[2 * j] = sh[k]
        out[2 * j + 1] = sh[k + 1]


def test_copies_land_in_shared_memory(cuda_ready):
    src = np.random.default_rng(0).integers(0, 2 ** 63, 2 * 32 * GROUPS, dtype=np.uint64)
    out = cuda_ready.to_device(np.zeros_like(src))
    _groups_kernel[1, 32](cuda_ready.to_device(src), out)
    np.testing.assert_array_equal(out.copy_to_host(), src)
