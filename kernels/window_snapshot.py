"""Window-ring snapshots for speculative verification: save the ring slots a call of up to S rows will overwrite, and
put back the slots of the rows a rollback rejects (ds4lib.ref.state.State.rollback is the specification: the ring
after a rollback is the ring of feeding only the kept rows).

Owns:
- `window_save`: for every layer l and i < S, save[l, i] = ring[l, (first + i) mod W] and save_pos[l, i] =
  ring_pos[l, (first + i) mod W]: the slots the positions first .. first + S - 1 map to, as they are before the call.
- `window_restore`: for i in keep .. count - 1, the saved slot goes back: the rows of rejected positions leave the
  ring, and the rows they had overwritten (positions W earlier, still inside the next query's window) return. The
  kept rows' slots (i < keep) keep what the call wrote.
One launch each for all layers: the backend keeps the rings of all backbone layers in one [L, W + C, Dh] array (ring
rows first, then the call's rows) and their slot positions in one [L, W] array. The first position is read on the
device (`first` an int64 array, its element 0: a call's positions), so a replayed graph snapshots and restores at
whatever position its call is; the launchers also take an int (uploaded).
Does not own: when a snapshot is taken or used (ds4lib.engine.cuda_state), the compressor's pending group and the
cache row counts.

Shapes: L layers, W window, C call rows after the ring, Dh head dim, S snapshot rows (<= W).
"""
import numpy as np
from numba import cuda

from kernels.pdl import grid_entry_device

__all__ = ["window_save", "window_restore", "window_save_kernel", "window_restore_kernel", "SIGNATURES"]

THREADS = 128


@cuda.jit(cache=True)
def window_save_kernel(ring, ring_pos, firsts, save, save_pos):
    """save[l, i, d] = ring[l, (first + i) % W, d]; save_pos[l, i] = ring_pos[l, (first + i) % W]; first = firsts[0]."""
    grid_entry_device()
    n_layers, n_save, dh = save.shape
    first = firsts[0]
    w = ring_pos.shape[1]
    g = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    if g >= n_layers * n_save * dh:
        return
    d = g % dh
    i = (g // dh) % n_save
    l = g // (dh * n_save)
    slot = (first + i) % w
    save[l, i, d] = ring[l, slot, d]
    if d == 0:
        save_pos[l, i] = ring_pos[l, slot]


@cuda.jit(cache=True)
def window_restore_kernel(save, save_pos, firsts, keep, count, ring, ring_pos):
    """ring[l, (first + i) % W] = save[l, i] (and its position) for keep <= i < count; first = firsts[0]."""
    grid_entry_device()
    n_layers, n_save, dh = save.shape
    first = firsts[0]
    w = ring_pos.shape[1]
    n = count - keep
    g = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    if g >= n_layers * n * dh:
        return
    d = g % dh
    i = keep + (g // dh) % n
    l = g // (dh * n)
    slot = (first + i) % w
    ring[l, slot, d] = save[l, i, d]
    if d == 0:
        ring_pos[l, slot] = save_pos[l, i]


SIGNATURES = {
    "window_save_kernel": "void(uint16[:, :, :], int64[:, :], int64[:], uint16[:, :, :], int64[:, :])",
    "window_restore_kernel": "void(uint16[:, :, :], int64[:, :], int64[:], int64, int64, uint16[:, :, :], "
                             "int64[:, :])",
}


def _check(ring, ring_pos, save, save_pos, what):
    if len(ring.shape) != 3 or ring.dtype != np.uint16 or len(save.shape) != 3 or save.dtype != np.uint16:
        raise ValueError(f"{what}: ring [L, W + C, Dh] and save [L, S, Dh] must be uint16")
    n_layers, n_save, dh = tuple(save.shape)
    w = ring_pos.shape[1] if len(ring_pos.shape) == 2 else -1
    if tuple(ring_pos.shape) != (n_layers, w) or ring.shape[0] != n_layers or ring.shape[2] != dh \
            or ring.shape[1] < w or not 0 < n_save <= w:
        raise ValueError(f"{what}: ring {ring.shape}, ring_pos {ring_pos.shape} and save {save.shape} disagree "
                         f"(S must be in 1..W)")
    if tuple(save_pos.shape) != (n_layers, n_save) or ring_pos.dtype != np.int64 or save_pos.dtype != np.int64:
        raise ValueError(f"{what}: ring_pos [L, W] and save_pos [L, S] must be int64")


def _firsts(first, what, stream):
    """The first position as a device int64 array (element 0 is read): an int is checked and uploaded."""
    if isinstance(first, (int, np.integer)):
        if first < 0:
            raise ValueError(f"{what}: first position must be >= 0")
        return cuda.to_device(np.array([int(first)], dtype=np.int64), stream=stream)
    if len(first.shape) != 1 or first.shape[0] < 1 or first.dtype != np.int64:
        raise ValueError(f"{what}: first must be an int or an int64 device array [>= 1] (its element 0 is read)")
    return first


def window_save(ring, ring_pos, first, save, save_pos, stream=0):
    """ring uint16 [L, W + C, Dh], ring_pos int64 [L, W] -> save uint16 [L, S, Dh], save_pos int64 [L, S]: the slots
    of positions first .. first + S - 1 (module docstring; `first` an int or a device array whose element 0 it is)."""
    _check(ring, ring_pos, save, save_pos, "window_save")
    firsts = _firsts(first, "window_save", stream)
    n = save.shape[0] * save.shape[1] * save.shape[2]
    if n:
        window_save_kernel[(n + THREADS - 1) // THREADS, THREADS, stream](ring, ring_pos, firsts, save, save_pos)


def window_restore(save, save_pos, first, keep, count, ring, ring_pos, stream=0):
    """Put back the saved slots of positions first + keep .. first + count - 1 (0 <= keep <= count <= S; `first` as
    in `window_save`)."""
    _check(ring, ring_pos, save, save_pos, "window_restore")
    if not 0 <= keep <= count <= save.shape[1]:
        raise ValueError(f"window_restore: need 0 <= keep ({keep}) <= count ({count}) <= S ({save.shape[1]})")
    firsts = _firsts(first, "window_restore", stream)
    n = save.shape[0] * (count - keep) * save.shape[2]
    if n:
        window_restore_kernel[(n + THREADS - 1) // THREADS, THREADS, stream](save, save_pos, firsts, int(keep),
                                                                             int(count), ring, ring_pos)
