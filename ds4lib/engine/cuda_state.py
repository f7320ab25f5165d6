"""Device session state of the CUDA backend, and its exact rollback for speculative verification (issue 13).

Owns `CudaState` (what persists between calls, on the device: the window rings of the backbone layers, the
ratio > 1 compressors' incomplete groups, the compressed KV and index-key caches; on the host: the position, the row
counts and the Engram history), `Rows` (a growable cache of BF16 rows), `new_state`, and `mark` / `rollback`.
Does not own: what a call writes (ds4lib.engine.backend_cuda) or the Engram hashes (ds4lib.ref.engram).

Rollback (ds4lib.ref.state.State.rollback is the specification): after `mark(st)`, one call of T <= S rows, and
`rollback(st, mark, n, ...)`, the state is that of feeding only the first n rows, by snapshotting only what the call
can touch:
- rings: the slots of positions F .. F + S - 1 of every layer, saved by one launch (kernels.window_snapshot); a
  rollback puts back those of the rejected rows, the kept rows' slots keep what the call wrote.
- incomplete groups: a copy of each ratio > 1 compressor's [ratio, Dh] kv and score rows at the mark, and, while the
  mark is open, each compressor's FP32 projections of the call kept in their own buffers (`log`); a rollback restores
  the copy and re-applies the compressor's state update to the kept rows only (kernels.compressor.compress with no
  group to pool: the same writes a call of the kept rows makes).
- caches: the row counts drop to the groups complete at the new position (rows past a count are never read).
- Engram history and position: the marked history hashed forward over the kept tokens (by the caller), F + n.
The device work is in launch-only functions (`snapshot_launches`, `rollback_launches`) that read the call's first
position on the device, so the backend can replay them from CUDA graphs: a lazy mark leaves the snapshot to the
call's own graph, and a rollback's launches are fixed by its (kept, fed) counts.
The live content of a state (`host_arrays`: ring rows and slot positions, the incomplete group's rows, the cache rows
in use, history, position) is what two states must share to give the same bits from then on.

Shapes: L backbone layers, W window, C call rows after the ring, Dh head dim, dI index head dim, S snapshot rows.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

import kernels  # noqa: F401  (numpy 2.5 alias for numba-cuda before anything compiles)
from numba import cuda

from kernels import compressor, window_snapshot

__all__ = ["CudaState", "CudaMark", "Rows", "new_state", "mark", "rollback", "snapshot_launches", "rollback_launches",
           "host_arrays", "clone", "nbytes", "snapshot", "restore", "reset", "copy_into"]

MIN_ROWS = 16                      # first capacity of a compressed-row cache


class Rows:
    """Device rows (BF16 bits) of a compressed cache: row s holds group s. The row count `n` lives on the host;
    capacity doubles, so growth is amortised O(rows)."""

    def __init__(self, width: int, stream):
        self.buf = cuda.device_array((MIN_ROWS, width), np.uint16, stream=stream)
        self.n = 0

    def reserve(self, need, stream):
        cap = self.buf.shape[0]
        if need <= cap:
            return
        while cap < need:
            cap *= 2
        buf = cuda.device_array((cap, self.buf.shape[1]), np.uint16, stream=stream)
        if self.n:
            buf[:self.n].copy_to_device(self.buf[:self.n], stream=stream)
        self.buf = buf

    def view(self, rows):
        return self.buf[:rows]


@dataclass
class CudaState:
    """One session's device state (module docstring)."""
    pos: int
    win: dict                      # layer -> uint16 [W + C, Dh]: ring rows, then the call's rows (a view of win_all)
    ring_pos: dict                 # layer -> int64 [W] (position held by each ring slot, -1 empty; a view)
    pend_kv: dict                  # layer -> float32 [ratio, Dh] (ratio > 1 compressors)
    pend_sc: dict
    ckv: dict                      # kv-source layer -> Rows(Dh)
    idxk: dict                     # index-key owner -> Rows(dI)
    hist: object                   # int64 [n-1] Engram history (host), or None
    win_all: object = None         # uint16 [L, W + C, Dh]
    ring_pos_all: object = None    # int64 [L, W]
    graphs: dict = field(default_factory=dict)     # bucket key -> cuda_graph.StepGraph
    log: dict | None = None        # open mark: compressor layer -> (kv, score) FP32 [T, Dh] of the call; "pos" -> [T]
    calls: int = 0                 # calls since the open mark
    snap: dict = field(default_factory=dict)       # snapshot buffers, allocated at the first mark and reused
    dwin_all: object = None        # DSpark stages' context rings (cuda_dspark.CudaDraft.add_rings), or None
    dring_pos_all: object = None
    dring_host: np.ndarray | None = None
    dfeat_pend: object = None      # float32 [W, F]: features of decode steps not yet appended (slot p % W)
    dpend: list = field(default_factory=list)      # their positions, consecutive (cuda_dspark.CudaDraft.defer)
    snap_pending: bool = False     # an open lazy mark whose snapshot the next call takes first (`mark`)


@dataclass
class CudaMark:
    """What `rollback` needs from before a call (`mark`)."""
    pos: int
    hist: np.ndarray | None
    rows: int                      # ring slots saved (S)


def new_state(cfg, roles, call_rows: int, with_hist: bool, stream) -> CudaState:
    """An empty state for calls of up to `call_rows` rows."""
    W, dh = cfg.window_size, cfg.head_dim
    layers = [r.layer for r in roles[:cfg.n_layers]]
    win_all = cuda.device_array((len(layers), W + call_rows, dh), np.uint16, stream=stream)
    ring_pos_all = cuda.to_device(np.full((len(layers), W), -1, dtype=np.int64), stream=stream)
    win, ring_pos, pkv, psc, ckv, idxk = {}, {}, {}, {}, {}, {}
    for i, l in enumerate(layers):
        r = roles[l]
        win[l], ring_pos[l] = win_all[i], ring_pos_all[i]
        if r.owns_compressor and r.ratio > 1:
            pkv[l] = cuda.to_device(np.zeros((r.ratio, dh), np.float32), stream=stream)
            psc[l] = cuda.to_device(np.zeros((r.ratio, dh), np.float32), stream=stream)
        if r.owns_compressor:
            ckv[l] = Rows(dh, stream)
        if r.indexer_owns_k:
            idxk[l] = Rows(cfg.index_head_dim, stream)
    hist = np.full(max(cfg.engram_max_ngram_size - 1, 1), -2, dtype=np.int64) if with_hist else None
    return CudaState(0, win, ring_pos, pkv, psc, ckv, idxk, hist, win_all, ring_pos_all)


def mark(st: CudaState, rows: int, stream, lazy: bool = False) -> CudaMark:
    """Snapshot what a call of up to `rows` rows at st.pos can change, and open the compressors' row log. `lazy`:
    the snapshot is left to the next call, which takes it first (`snapshot_launches` at its device positions: inside a
    replayed verify graph); `st.snap_pending` says it is still to be taken."""
    L, _, dh = st.win_all.shape
    rows = min(int(rows), st.ring_pos_all.shape[1])
    if st.snap.get("rows") != rows:
        st.snap = {"rows": rows, "win": cuda.device_array((L, rows, dh), np.uint16, stream=stream),
                   "pos": cuda.device_array((L, rows), np.int64, stream=stream),
                   "pend": {l: (cuda.device_array_like(kv, stream=stream), cuda.device_array_like(kv, stream=stream))
                            for l, kv in st.pend_kv.items()}}
    st.log, st.calls = {}, 0
    st.snap_pending = bool(lazy)
    if not lazy:
        snapshot_launches(st, st.pos, stream)
    return CudaMark(st.pos, None if st.hist is None else st.hist.copy(), rows)


def snapshot_launches(st: CudaState, first, stream) -> None:
    """A mark's snapshot: the ring slots of positions first .. first + S - 1 (`first` an int, or the device positions
    of the call about to run) and each ratio > 1 compressor's incomplete group. Launches only (a graph may hold
    them)."""
    window_snapshot.window_save(st.win_all, st.ring_pos_all, first, st.snap["win"], st.snap["pos"], stream=stream)
    for l, (kv, sc) in st.snap["pend"].items():
        kv.copy_to_device(st.pend_kv[l], stream=stream)
        sc.copy_to_device(st.pend_sc[l], stream=stream)
    st.snap_pending = False


def rollback_launches(st: CudaState, n: int, fed: int, ratios: dict, norm_w: dict, eps: float, stream) -> None:
    """The device part of `rollback` keeping n of the fed rows (n < fed): the rejected rows' ring slots put back (the
    call's first position read from its logged device positions), the incomplete groups restored and the kept rows'
    state update re-applied. Launches only, their shapes fixed by (n, fed): a graph may hold them."""
    window_snapshot.window_restore(st.snap["win"], st.snap["pos"], st.log["pos"], n, fed, st.win_all,
                                   st.ring_pos_all, stream=stream)
    for l, (kv, sc) in st.snap["pend"].items():
        st.pend_kv[l].copy_to_device(kv, stream=stream)
        st.pend_sc[l].copy_to_device(sc, stream=stream)
        if n:
            lkv, lsc = st.log[l]
            compressor.compress(lkv[:n], lsc[:n], st.pend_kv[l], st.pend_sc[l], st.log["pos"][:n], ratios[l],
                                norm_w[l], eps, 0, out=None, stream=stream)


def rollback(st: CudaState, mk: CudaMark, n: int, hist, ratios: dict, norm_w: dict, eps: float, stream,
             launches=None) -> None:
    """Keep the first n rows fed since `mk` (module docstring). `hist`: the Engram history after the kept tokens;
    `ratios`: compressor layer -> ratio; `norm_w`: compressor layer -> its norm weight (the launcher checks shapes).
    `launches(n, fed)`: runs `rollback_launches` (the backend replays them from a graph); default: eagerly."""
    if st.log is None:
        raise ValueError("rollback without a mark (or the mark was already rolled back)")
    fed = st.pos - mk.pos
    if not 0 <= n <= fed:
        raise ValueError(f"rollback keeps {n} rows but {fed} were fed since the mark")
    if fed and (st.calls != 1 or fed > mk.rows):
        raise ValueError(f"rollback after {st.calls} calls of {fed} rows: one call of at most {mk.rows} rows "
                         f"can be rolled back")
    end = mk.pos + n
    if n < fed:
        if launches is None:
            rollback_launches(st, n, fed, ratios, norm_w, eps, stream)
        else:
            launches(n, fed)
        for caches in (st.ckv, st.idxk):
            for l, r in caches.items():
                r.n = min(r.n, end // ratios[l])
    st.hist = hist
    st.pos = end
    st.log, st.calls, st.snap_pending = None, 0, False


def host_arrays(st: CudaState, ratios: dict) -> dict:
    """The live content of a state as host arrays (module docstring); the incomplete group as its rows in position
    order (slots of earlier groups are never read again)."""
    out = {"pos": np.array([st.pos]), "ring": st.win_all.copy_to_host()[:, :st.ring_pos_all.shape[1]],
           "ring_pos": st.ring_pos_all.copy_to_host()}
    for l in st.pend_kv:
        r = ratios[l]
        slots = np.arange(st.pos // r * r, st.pos) % r
        out[f"pend_kv.{l}"] = st.pend_kv[l].copy_to_host()[slots]
        out[f"pend_sc.{l}"] = st.pend_sc[l].copy_to_host()[slots]
    for name, caches in (("ckv", st.ckv), ("idxk", st.idxk)):
        for l, rows in caches.items():
            out[f"{name}.{l}"] = rows.buf.copy_to_host()[:rows.n]
    if st.hist is not None:
        out["hist"] = np.asarray(st.hist).copy()
    if st.dwin_all is not None:
        ring = st.dwin_all.copy_to_host()[:, :len(st.dring_host)]
        ring[:, st.dring_host < 0] = 0                 # slots never written hold whatever the allocation held
        out["dring"] = ring
        out["dring_pos"] = st.dring_pos_all.copy_to_host()
        out["dring_host"] = st.dring_host.copy()
        out["dpend"] = np.array(st.dpend, dtype=np.int64)
        if st.dpend:
            W = st.dfeat_pend.shape[0]
            out["dfeat_pend"] = st.dfeat_pend.copy_to_host()[np.array(st.dpend[-W:]) % W]
    return out


def nbytes(st: CudaState) -> int:
    """Bytes a state holds (device buffers, each counted once, and the host Engram history): what the prefix cache
    budgets a stored state at. Snapshot buffers of a mark and captured graphs are not counted (a stored state has
    neither: ds4lib.engine.backend_cuda.CudaBackend.park_state)."""
    bufs = [st.win_all, st.ring_pos_all, *st.pend_kv.values(), *st.pend_sc.values(),
            *(r.buf for r in st.ckv.values()), *(r.buf for r in st.idxk.values()),
            st.dwin_all, st.dring_pos_all, st.dfeat_pend]
    total = sum(int(b.nbytes) for b in bufs if b is not None)
    if st.hist is not None:
        total += int(np.asarray(st.hist).nbytes)
    return total


def snapshot(st: CudaState) -> dict:
    """A state as named host arrays, for the prefix cache's disk tier (`restore` makes the state again): the ring rows
    and positions, the incomplete groups, the cache rows in use, the Engram history, the DSpark rings and pending rows.
    A call's scratch rows after the ring, captured graphs and an open mark are not part of it."""
    if st.log is not None:
        raise ValueError("snapshot: the state has an open mark")
    W = st.ring_pos_all.shape[1]
    out = {"pos": np.array([st.pos], np.int64), "ring": st.win_all.copy_to_host()[:, :W],
           "ring_pos": st.ring_pos_all.copy_to_host()}
    for l in st.pend_kv:
        out[f"pend_kv.{l}"] = st.pend_kv[l].copy_to_host()
        out[f"pend_sc.{l}"] = st.pend_sc[l].copy_to_host()
    for name, caches in (("ckv", st.ckv), ("idxk", st.idxk)):
        for l, rows in caches.items():
            out[f"{name}.{l}"] = rows.buf[:max(rows.n, 1)].copy_to_host()[:rows.n]
    if st.hist is not None:
        out["hist"] = np.asarray(st.hist, np.int64).copy()
    if st.dwin_all is not None:
        out["dring"] = st.dwin_all.copy_to_host()[:, :W]
        out["dring_pos"] = st.dring_pos_all.copy_to_host()
        out["dring_host"] = st.dring_host.copy()
        out["dfeat_pend"] = st.dfeat_pend.copy_to_host()
        out["dpend"] = np.array(st.dpend, np.int64)
    return out


def restore(template: CudaState, arrays: dict, stream) -> CudaState:
    """`template` (a new state of the same backend) filled from `snapshot`'s arrays; ValueError naming the first array
    that is missing, extra or of another shape or dtype (an entry of another model or layout)."""
    st = template
    W = st.ring_pos_all.shape[1]
    want = {"pos": ((1,), np.int64), "ring": ((st.win_all.shape[0], W, st.win_all.shape[2]), np.uint16),
            "ring_pos": (tuple(st.ring_pos_all.shape), np.int64)}
    for l, a in st.pend_kv.items():
        want[f"pend_kv.{l}"] = want[f"pend_sc.{l}"] = (tuple(a.shape), np.float32)
    for name, caches in (("ckv", st.ckv), ("idxk", st.idxk)):
        for l, rows in caches.items():
            want[f"{name}.{l}"] = ((None, rows.buf.shape[1]), np.uint16)
    if st.hist is not None:
        want["hist"] = (tuple(np.shape(st.hist)), np.int64)
    if st.dwin_all is not None:
        want["dring"] = ((st.dwin_all.shape[0], W, st.dwin_all.shape[2]), np.uint16)
        want["dring_pos"] = (tuple(st.dring_pos_all.shape), np.int64)
        want["dring_host"] = (st.dring_host.shape, np.int64)
        want["dfeat_pend"] = (tuple(st.dfeat_pend.shape), np.float32)
        want["dpend"] = ((None,), np.int64)
    extra = sorted(set(arrays) - set(want))
    if extra:
        raise ValueError(f"state snapshot has arrays this state does not: {extra[:3]}")
    for k, (shape, dt) in want.items():
        if k not in arrays:
            raise ValueError(f"state snapshot lacks {k}")
        a = arrays[k]
        if a.dtype != dt or a.ndim != len(shape) or any(w is not None and w != g for w, g in zip(shape, a.shape)):
            raise ValueError(f"state snapshot {k}: {a.dtype}{list(a.shape)} does not fit {np.dtype(dt)}{list(shape)}")
    st.pos = int(arrays["pos"][0])
    for i in range(st.win_all.shape[0]):               # [:, :W] of [L, W + C, Dh] is not one region: per layer
        st.win_all[i, :W].copy_to_device(np.ascontiguousarray(arrays["ring"][i]), stream=stream)
    st.ring_pos_all.copy_to_device(np.ascontiguousarray(arrays["ring_pos"]), stream=stream)
    for l in st.pend_kv:
        st.pend_kv[l].copy_to_device(np.ascontiguousarray(arrays[f"pend_kv.{l}"]), stream=stream)
        st.pend_sc[l].copy_to_device(np.ascontiguousarray(arrays[f"pend_sc.{l}"]), stream=stream)
    for name, caches in (("ckv", st.ckv), ("idxk", st.idxk)):
        for l, rows in caches.items():
            a = np.ascontiguousarray(arrays[f"{name}.{l}"])
            rows.reserve(max(len(a), 1), stream)
            if len(a):
                rows.buf[:len(a)].copy_to_device(a, stream=stream)
            rows.n = len(a)
    if st.hist is not None:
        st.hist = np.array(arrays["hist"], np.int64)
    if st.dwin_all is not None:
        for i in range(st.dwin_all.shape[0]):
            st.dwin_all[i, :W].copy_to_device(np.ascontiguousarray(arrays["dring"][i]), stream=stream)
        st.dring_pos_all.copy_to_device(np.ascontiguousarray(arrays["dring_pos"]), stream=stream)
        st.dring_host = np.array(arrays["dring_host"], np.int64)
        st.dfeat_pend.copy_to_device(np.ascontiguousarray(arrays["dfeat_pend"]), stream=stream)
        st.dpend = [int(p) for p in arrays["dpend"]]
    stream.synchronize()                               # the host arrays may be freed once this returns
    return st


def clone(st: CudaState, stream) -> CudaState:
    """A device copy of a state (the prefix cache's copies; tests and diagnostics). An open mark's snapshot and row
    log are shared, not copied; without an open mark the copy gets snapshot buffers of its own at its first mark.
    Decode graphs are not carried over: they point at the original's buffers."""
    def dup(a):
        b = cuda.device_array(a.shape, a.dtype, stream=stream)
        b.copy_to_device(a, stream=stream)
        return b
    win_all, ring_pos_all = dup(st.win_all), dup(st.ring_pos_all)
    layers = sorted(st.win)
    caches = []
    for src in (st.ckv, st.idxk):
        out = {}
        for l, r in src.items():
            c = Rows(r.buf.shape[1], stream)
            c.buf, c.n = dup(r.buf), r.n
            out[l] = c
        caches.append(out)
    out = CudaState(st.pos, {l: win_all[i] for i, l in enumerate(layers)},
                    {l: ring_pos_all[i] for i, l in enumerate(layers)},
                    {l: dup(a) for l, a in st.pend_kv.items()}, {l: dup(a) for l, a in st.pend_sc.items()},
                    caches[0], caches[1], None if st.hist is None else st.hist.copy(), win_all, ring_pos_all,
                    log=None if st.log is None else dict(st.log), calls=st.calls,
                    snap=st.snap if st.log is not None else {}, snap_pending=st.snap_pending)
    if st.dwin_all is not None:
        out.dwin_all, out.dring_pos_all, out.dring_host = dup(st.dwin_all), dup(st.dring_pos_all), st.dring_host.copy()
        out.dfeat_pend, out.dpend = dup(st.dfeat_pend), list(st.dpend)
    return out


def reset(st: CudaState, stream) -> CudaState:
    """`st` made empty again in place, as `new_state` makes one, keeping its buffers (and so the decode graphs
    captured over them): position 0, every ring slot and DSpark ring slot empty (-1), the incomplete groups zero, no
    cache rows, the Engram history and pending DSpark rows cleared. Slots and rows past the counts are never read,
    so what they still hold does not matter."""
    if st.log is not None:
        raise ValueError("reset: the state has an open mark")
    st.pos = 0
    st.ring_pos_all.copy_to_device(np.full(tuple(st.ring_pos_all.shape), -1, np.int64), stream=stream)
    for d in (st.pend_kv, st.pend_sc):
        for a in d.values():
            a.copy_to_device(np.zeros(tuple(a.shape), np.float32), stream=stream)
    for caches in (st.ckv, st.idxk):
        for rows in caches.values():
            rows.n = 0
    if st.hist is not None:
        st.hist = np.full(np.shape(st.hist), -2, dtype=np.int64)
    if st.dwin_all is not None:
        st.dring_pos_all.copy_to_device(np.full(tuple(st.dring_pos_all.shape), -1, np.int64), stream=stream)
        st.dring_host = np.full(len(st.dring_host), -1, dtype=np.int64)
        st.dpend = []
    st.calls = 0
    stream.synchronize()                               # the host arrays may be freed once this returns
    return st


def copy_into(dst: CudaState, src: CudaState, stream) -> CudaState:
    """`dst` (a state of the same backend, no open mark) made a copy of `src` in place, keeping dst's buffers (a
    cache row buffer grows if src holds more rows): the same live content as `clone`, without allocating."""
    if dst.log is not None or src.log is not None:
        raise ValueError("copy_into: a state has an open mark")
    if tuple(dst.win_all.shape) != tuple(src.win_all.shape) or set(dst.ckv) != set(src.ckv) \
            or set(dst.idxk) != set(src.idxk) or (dst.dwin_all is None) != (src.dwin_all is None):
        raise ValueError("copy_into: the states are of different layouts")
    dst.pos = src.pos
    dst.win_all.copy_to_device(src.win_all, stream=stream)
    dst.ring_pos_all.copy_to_device(src.ring_pos_all, stream=stream)
    for d, s in ((dst.pend_kv, src.pend_kv), (dst.pend_sc, src.pend_sc)):
        for l, a in s.items():
            d[l].copy_to_device(a, stream=stream)
    for dcaches, scaches in ((dst.ckv, src.ckv), (dst.idxk, src.idxk)):
        for l, rows in scaches.items():
            out = dcaches[l]
            out.n = 0                                  # nothing to carry over when it grows
            out.reserve(max(rows.n, 1), stream)
            if rows.n:
                out.buf[:rows.n].copy_to_device(rows.buf[:rows.n], stream=stream)
            out.n = rows.n
    dst.hist = None if src.hist is None else np.array(src.hist, np.int64)
    if src.dwin_all is not None:
        dst.dwin_all.copy_to_device(src.dwin_all, stream=stream)
        dst.dring_pos_all.copy_to_device(src.dring_pos_all, stream=stream)
        dst.dring_host = src.dring_host.copy()
        dst.dfeat_pend.copy_to_device(src.dfeat_pend, stream=stream)
        dst.dpend = list(src.dpend)
    dst.calls = 0
    return dst
