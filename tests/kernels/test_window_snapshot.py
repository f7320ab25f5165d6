"""kernels/window_snapshot.py: the ring after write + restore equals the ring of writing only the kept rows
(kernels.attention.window_write is the ring's writer; ds4lib.ref.state.State.rollback the specification)."""
import numpy as np
import pytest


def _rings(cuda, rng, L, W, C, dh, first):
    """Rings as after feeding positions 0 .. first - 1 (slot p % W holds the newest p), random row bits."""
    ring = rng.integers(0, 1 << 16, (L, W + C, dh), dtype=np.uint16)
    pos = np.full((L, W), -1, dtype=np.int64)
    p = np.arange(max(0, first - W), first)
    pos[:, p % W] = p
    return ring, pos


@pytest.mark.parametrize("first,count", [(0, 5), (3, 5), (13, 5), (16, 1), (29, 8), (40, 3)])
def test_restore_leaves_the_ring_of_the_kept_rows(cuda_ready, first, count):
    from kernels.attention import window_write
    from kernels.window_snapshot import window_restore, window_save
    cuda = cuda_ready
    rng = np.random.default_rng(first * 10 + count)
    L, W, C, dh, S = 3, 8, 6, 12, 8
    ring0, pos0 = _rings(cuda, rng, L, W, C, dh, first)
    # BF16-valued float32 rows of the call, as the backend writes them
    kv = (rng.standard_normal((L, count, dh)).astype(np.float32).view(np.uint32) & 0xFFFF0000).view(np.float32)
    positions = np.arange(first, first + count, dtype=np.int64)
    for keep in range(count + 1):
        d_ring, d_pos = cuda.to_device(ring0), cuda.to_device(pos0)
        save, save_pos = cuda.device_array((L, S, dh), np.uint16), cuda.device_array((L, S), np.int64)
        at = first if keep % 2 else cuda.to_device(positions)     # an int, or read on the device (a call's positions)
        window_save(d_ring, d_pos, at, save, save_pos)
        for l in range(L):
            window_write(cuda.to_device(kv[l]), cuda.to_device(positions), d_ring[l][:W], d_pos[l])
        window_restore(save, save_pos, at, keep, count, d_ring, d_pos)
        want_ring, want_pos = cuda.to_device(ring0), cuda.to_device(pos0)
        if keep:
            for l in range(L):
                window_write(cuda.to_device(kv[l, :keep]), cuda.to_device(positions[:keep]), want_ring[l][:W],
                             want_pos[l])
        np.testing.assert_array_equal(d_pos.copy_to_host(), want_pos.copy_to_host(), err_msg=f"keep {keep}")
        np.testing.assert_array_equal(d_ring.copy_to_host()[:, :W], want_ring.copy_to_host()[:, :W],
                                      err_msg=f"keep {keep}")
        np.testing.assert_array_equal(d_ring.copy_to_host()[:, W:], ring0[:, W:])     # call rows untouched


def test_launchers_check_shapes(cuda_ready):
    from kernels.window_snapshot import window_restore, window_save
    cuda = cuda_ready
    ring, pos = cuda.device_array((2, 10, 4), np.uint16), cuda.device_array((2, 8), np.int64)
    with pytest.raises(ValueError, match="S must be in 1..W"):
        window_save(ring, pos, 0, cuda.device_array((2, 9, 4), np.uint16), cuda.device_array((2, 9), np.int64))
    save, save_pos = cuda.device_array((2, 4, 4), np.uint16), cuda.device_array((2, 4), np.int64)
    with pytest.raises(ValueError, match="keep"):
        window_restore(save, save_pos, 0, 3, 5, ring, pos)
    with pytest.raises(ValueError, match="first"):
        window_save(ring, pos, -1, save, save_pos)
    with pytest.raises(ValueError, match="int64 device array"):
        window_save(ring, pos, cuda.device_array(1, np.int32), save, save_pos)
