"""kernels/prefetch.py: which bytes the L2 prefetch asks for (simulator), what it refuses, its sm_90 PTX, and that
it runs on a GPU without changing anything."""
import numpy as np
import pytest

import kernels.prefetch as pf


@pytest.mark.simulator             # records the device function's calls through a Python stand-in
@pytest.mark.parametrize("n0,n1", [(3 * pf.CHUNK + 144, 0),              # a tail chunk, one array
                                   (144 * 9, 5 * pf.CHUNK),              # a short first array, a long second
                                   (pf.CHUNK * pf.BLOCKS * pf.THREADS + 32, 48)])   # more chunks than threads
def test_the_chunks_cover_each_array_once(cuda_ready, monkeypatch, n0, n1):
    """Every byte of a0[:n0] and a1[:n1] is asked for exactly once, in pieces of at most CHUNK bytes on 16-byte
    boundaries, and nothing past them (the kernel's loop, through a recording stand-in for the instruction)."""
    calls = []
    monkeypatch.setattr(pf, "prefetch_l2_device", lambda ary, i, nbytes: calls.append((len(ary), int(i), int(nbytes))))
    a0 = cuda_ready.to_device(np.zeros(n0, np.uint8))
    a1 = cuda_ready.to_device(np.zeros(max(n1, 16), np.uint8))
    pf.l2_prefetch_kernel[1, 4](a0, n0, a1, n1)       # 4 threads: each takes many chunks in turn
    for size, n in ((n0, n0), (max(n1, 16), n1)):
        got = sorted((i, b) for s, i, b in calls if s == size)
        assert all(0 < b <= pf.CHUNK and i % pf.ALIGN == 0 and b % pf.ALIGN == 0 and i + b <= n
                   for i, b in got), got[:4]
        covered = np.zeros(size, np.int64)
        for i, b in got:
            covered[i:i + b] += 1
        assert (covered[:n] == 1).all() and not covered[n:].any()
    assert len(calls) == -(-n0 // pf.CHUNK) - (-n1 // pf.CHUNK)


def test_l2_prefetch_refuses_what_the_instruction_cannot_take(cuda_ready):
    w = cuda_ready.to_device(np.zeros((4, 144), np.uint8))
    with pytest.raises(ValueError, match="must be uint8"):
        pf.l2_prefetch([cuda_ready.to_device(np.zeros(36, np.float32))])
    with pytest.raises(ValueError, match="C-contiguous"):
        pf.l2_prefetch([cuda_ready.to_device(np.zeros((4, 144), np.uint8).T)])
    with pytest.raises(ValueError, match="not on 16 bytes"):
        pf.l2_prefetch([cuda_ready.to_device(np.zeros(100, np.uint8))])
    with pytest.raises(ValueError, match="one or two arrays, got 3"):
        pf.l2_prefetch([w, w, w])
    with pytest.raises(ValueError, match="one or two arrays, got 0"):
        pf.l2_prefetch([])


def test_l2_prefetch_runs_and_changes_nothing(cuda_ready):
    """One and two arrays (2-D q4_K-shaped bytes, flattened by the launcher): they read back unchanged."""
    rng = np.random.default_rng(3)
    a = rng.integers(0, 256, (64, 144 * 4), dtype=np.uint8)
    b = rng.integers(0, 256, (3, pf.CHUNK + 16), dtype=np.uint8)
    da, db = cuda_ready.to_device(a), cuda_ready.to_device(b)
    pf.l2_prefetch([da])
    pf.l2_prefetch([da, db])
    cuda_ready.synchronize()
    np.testing.assert_array_equal(da.copy_to_host(), a)
    np.testing.assert_array_equal(db.copy_to_host(), b)


def test_the_prefetch_is_a_bulk_l2_prefetch_a_branch():
    """Compiled for sm_90: the kernel holds the instruction (once in each array's branch) and no store to global
    memory."""
    from tests.kernels.compile_sm90 import ptx_counts
    r = ptx_counts(["prefetch:l2_prefetch_kernel"], [pf.PREFETCH_PTX, "st.global"])["prefetch:l2_prefetch_kernel"]
    assert (r["sm90"], r[pf.PREFETCH_PTX], r["st.global"]) == (True, 2, 0), r
