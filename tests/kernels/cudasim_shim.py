"""Warp intrinsics for Numba's CUDA simulator, which has none (docs/toolchain.md §2.3).

Each call publishes the lane's value in a per-block table keyed by thread id, waits at a block barrier,
reads the source lane, and waits again. Semantics therefore need every live thread of the block to
reach the call, which holds for the warp-synchronous kernels of this project.

install() also fixes three costs and a race of the simulator itself: blocks run one simulated thread at a time, each a
greenlet on one OS thread that switches at each barrier (block_scheduler_with_greenlets; without the greenlet package,
a reused pool of OS threads handing a baton on at each barrier, block_scheduler_with_baton: numba starts an OS thread
per simulated thread and polls them all in a busy loop, so a launch paid ~0.3 ms per thread and a barrier cost many
GIL hand-offs), a device-function call no longer scans its module's globals (fast_device_calls), and shared arrays are
allocated under a lock (lock_simulator_shared_arrays).
"""
import sys
import threading
import types

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
        dtype = np.dtype(dtype)                    # a NumPy scalar type (np.uint64) has no itemsize of its own
        if shape == 0:
            count = self._dynshared_size // dtype.itemsize
            return np.frombuffer(self._dynshared.data, dtype=dtype, count=count)
        f = sys._getframe(1)                       # allocations are keyed by call site (file, line), as numba's
        caller = (f.f_code.co_filename, f.f_lineno)     # traceback.extract_stack(...)[-2][0:2], without the walk
        with lock:
            res = self._allocations.get(caller)
            if res is None:
                res = np.empty(shape, dtype)
                self._allocations[caller] = res
        return res

    kernelapi.FakeCUDAShared.array = array
    kernelapi.FakeCUDAShared._ds4_locked = True


class _SimThread(threading.Thread):
    """A worker of `_POOL` that runs one simulated CUDA thread of a block at a time, with the attributes numba's
    simulator reads from `threading.current_thread()` (threadIdx, blockIdx, thread_id, syncthreads, ...)."""

    def __init__(self):
        super().__init__(daemon=True)
        self.baton = threading.Lock()
        self.baton.acquire()
        self.job = None

    def assign(self, manager, target, index, block_idx, thread_idx):
        from numba.cuda.simulator.kernelapi import Dim3
        self._manager, self.job, self.index = manager, target, index
        self.blockIdx, self.threadIdx = Dim3(*block_idx), Dim3(*thread_idx)
        bd = manager._block_dim
        self.thread_id = self.threadIdx.x + bd[0] * (self.threadIdx.y + bd[1] * self.threadIdx.z)
        self.done = self.arrived = False
        self.exception = None

    def run(self):
        while True:
            self.baton.acquire()                     # the block hands this thread the baton to start
            m = self._manager
            if m.failed is None:
                try:
                    self.job()
                except BaseException as e:
                    self.exception = (_named(e, self.threadIdx, self.blockIdx), sys.exc_info()[2])
                    if m.failed is None:
                        m.failed = self.exception
            self.done = True
            m.pass_baton(self)

    def syncthreads(self):
        m = self._manager
        if m.failed is not None:
            raise RuntimeError("abort flag set on syncthreads call")
        self.arrived = True
        m.pass_baton(self)
        self.baton.acquire()
        if m.failed is not None:
            raise RuntimeError("abort flag set on syncthreads clear")


_POOL = []          # worker threads, reused by every block of every launch (launches never overlap: the simulator
                    # asserts one kernel context at a time)


def _named(e, thread_idx, block_idx):
    """`e` re-made with the simulator's message, the thread and block ids first (`e` itself for an exception type
    that does not take one message)."""
    msg = f"tid={list(thread_idx)} ctaid={list(block_idx)}" + (f": {e}" if str(e) else "")
    try:
        return type(e)(msg)
    except Exception:
        return e


def block_scheduler_with_baton():
    """Replace the simulator's block scheduler (numba-cuda 0.30.4 `BlockManager`). It starts an OS thread per
    simulated thread and block, and its launching thread polls all of them in a busy loop to see whether all have
    reached `syncthreads`, competing with them for the GIL. Here a pool of worker threads is reused, and one
    simulated thread runs at a time, handing a baton to the next when it reaches a barrier or returns: one thread
    switch per step. The semantics are the simulator's: a barrier waits for the threads that are still running (a
    thread that has returned no longer counts), and an exception in one thread aborts the block's other threads at
    their next barrier and is raised by the launch. Threads run in thread-id order between barriers (neither the
    hardware nor the original simulator promise an order; a kernel that depends on one is wrong on both).
    Installed by install()."""
    from numba.cuda.simulator import kernel
    if getattr(kernel.BlockManager, "_ds4_baton", False):
        return
    for name in ("syncthreads_count", "syncthreads_and", "syncthreads_or"):
        setattr(_SimThread, name, getattr(kernel.BlockThread, name))

    class BlockManager(kernel.BlockManager):
        _ds4_baton = True

        def pass_baton(self, me):
            """Wake the next running thread after `me` that has not reached the barrier; when every running
            thread has, open the barrier and go on from the first; when none runs, the block is done."""
            n = len(self.threads)
            for k in range(1, n + 1):
                t = self.threads[(me.index + k) % n]
                if not t.done and not t.arrived:
                    break
            else:
                live = [t for t in self.threads if not t.done]
                if not live:
                    self.finished.release()
                    return
                for t in live:
                    t.arrived = False
                t = live[0]
            t.baton.release()                        # t may be me, alone at the barrier: it goes on at once

        def run(self, grid_point, *args):
            def target():
                self._f(*args)

            points = list(np.ndindex(*self._block_dim))
            while len(_POOL) < len(points):
                w = _SimThread()
                w.start()
                _POOL.append(w)
            self.failed = None
            self.finished = threading.Lock()
            self.finished.acquire()
            self.threads = _POOL[:len(points)]
            for i, (t, p) in enumerate(zip(self.threads, points)):
                t.assign(self, target, i, grid_point, p)
            self.threads[0].baton.release()
            try:
                self.finished.acquire()
            except BaseException:                    # interrupted (Ctrl-C): these workers may be mid-block
                del _POOL[:len(points)]
                raise
            if self.failed is not None:
                raise self.failed[0].with_traceback(self.failed[1])

    kernel.BlockManager = BlockManager


class _GreenletRunner(threading.Thread):
    """The one OS thread on which `block_scheduler_with_greenlets` runs every simulated thread, each a greenlet. It
    carries the attributes numba's simulator reads from `threading.current_thread()` (threadIdx, blockIdx, thread_id,
    syncthreads, ...), set to the running simulated thread's before each switch into it."""

    def __init__(self):
        super().__init__(daemon=True)
        self.job = None
        self.ready = threading.Lock()
        self.ready.acquire()
        self.finished = threading.Lock()
        self.finished.acquire()

    def run(self):
        while True:
            self.ready.acquire()                     # a block to run (run_block)
            try:
                self.job()
            finally:
                self.finished.release()

    def syncthreads(self):
        m = self._manager
        if m.failed is not None:
            raise RuntimeError("abort flag set on syncthreads call")
        self._scheduler.switch()                     # back to run_block, which resumes threads in thread-id order
        if m.failed is not None:
            raise RuntimeError("abort flag set on syncthreads clear")


_RUNNER = []        # the one _GreenletRunner, started at the first launch


def block_scheduler_with_greenlets():
    """Replace the simulator's block scheduler (numba-cuda 0.30.4 `BlockManager`) with one that runs each simulated
    thread as a greenlet on one OS thread, switching at each barrier: a switch costs ~1 us where handing a baton
    between OS threads (block_scheduler_with_baton) costs ~10-30 us, and the barriers of warp shuffles dominate
    simulated kernels. Same semantics and order as block_scheduler_with_baton: threads run in thread-id order between
    barriers, a barrier waits for the threads that are still running (a thread that has returned no longer counts),
    and an exception in one thread aborts the block's other threads at their next barrier (threads not yet started
    do not start) and is raised by the launch. Returns False (and installs nothing) without the greenlet package.
    Installed by install()."""
    try:
        import greenlet
    except ImportError:
        return False
    from numba.cuda.simulator import kernel
    from numba.cuda.simulator.kernelapi import Dim3
    if getattr(kernel.BlockManager, "_ds4_greenlets", False):
        return True
    for name in ("syncthreads_count", "syncthreads_and", "syncthreads_or"):
        setattr(_GreenletRunner, name, getattr(kernel.BlockThread, name))

    class BlockManager(kernel.BlockManager):
        _ds4_greenlets = True

        def run(self, grid_point, *args):
            if not _RUNNER:
                _RUNNER.append(_GreenletRunner())
                _RUNNER[0].start()
            runner = _RUNNER[0]
            self.failed = None
            runner.job = lambda: self.run_block(runner, grid_point, args)
            runner.ready.release()
            runner.finished.acquire()
            if self.failed is not None:
                raise self.failed[0].with_traceback(self.failed[1])

        def run_block(self, runner, grid_point, args):
            bd = self._block_dim
            block_idx = Dim3(*grid_point)
            runner._manager, runner.blockIdx = self, block_idx
            runner._scheduler = greenlet.getcurrent()
            points = list(np.ndindex(*bd))
            ids = [Dim3(*p) for p in points]

            def body(thread_idx):
                if self.failed is not None:          # a thread before this one failed: this one never starts
                    return
                try:
                    self._f(*args)
                except BaseException as e:
                    if self.failed is None:
                        self.failed = (_named(e, thread_idx, block_idx), sys.exc_info()[2])

            live = [(greenlet.greenlet(body), t, t.x + bd[0] * (t.y + bd[1] * t.z)) for t in ids]
            first = True
            while live:
                for g, t, tid in live:
                    runner.threadIdx, runner.thread_id = t, tid
                    if first:
                        g.switch(t)
                    else:
                        g.switch()
                first = False
                live = [x for x in live if not x[0].dead]

    kernel.BlockManager = BlockManager
    return True


def _global_names(code, g, seen=None):
    """The global names a code object may read: its own, those of the code nested in it (comprehensions, lambdas)
    and those of the plain Python functions of the same module it names (a simulator-only helper reads the module's
    globals as swapped for its caller)."""
    seen = set() if seen is None else seen
    if id(code) in seen:
        return set()
    seen.add(id(code))
    out = set(code.co_names)
    for c in code.co_consts:
        if hasattr(c, "co_names"):
            out |= _global_names(c, g, seen)
    for name in code.co_names:
        f = g.get(name)
        if isinstance(f, types.FunctionType) and f.__globals__ is g:
            out |= _global_names(f.__code__, g, seen)
    return out


def fast_device_calls():
    """Make a simulated device-function call cheap. numba-cuda 0.30.4's `FakeCUDAKernel.__call__` enters
    `kernelapi.swapped_cuda_module` on every device call: a context manager that takes two locks and, when the callee's
    module is not swapped yet (a call into another module: kernels.mma, kernels.fp8, ...), scans all of that module's
    globals for the `cuda` module, about 20 us a call; a simulated q4_K tensor-core GEMV makes ~100,000 such calls a
    block. This replaces the device branch with the same swap on the same bookkeeping (the simulator's refcount and
    saved-globals dicts, so a launch's own swap and these nest as before), the names bound to `cuda` found once per
    module, no swap at all for a function whose code never reads those names (its callees swap for themselves), and
    no locks: the simulated threads of a launch run one at a time (greenlets on one OS thread, or OS threads handing
    on a baton), so nothing enters a module's swap concurrently. Kernel launches keep numba's path. A simulated
    q4_K tensor-core GEMV ran 5x faster with it and the E4M3 table of kernels.mma. Installed by install()."""
    from numba import cuda
    from numba.cuda.simulator import kernel, kernelapi
    if getattr(kernel.FakeCUDAKernel, "_ds4_fast_calls", False):
        return
    launch = kernel.FakeCUDAKernel.__call__
    refcount, saved = kernelapi._swap_refcount, kernelapi._swap_orig
    names = {}                                   # id(module globals) -> names bound to the real cuda module
    needs = {}                                   # id(function) -> whether its code reads one of those names

    def call(self, *args):
        if not (self._device or kernel._kernel_context):
            return launch(self, *args)           # a launch from the host
        fn = self.fn
        g = fn.__globals__
        gid = id(g)
        keys = names.get(gid)
        if keys is None:
            keys = names[gid] = tuple(k for k, v in g.items()      # the module may be swapped by a launch now
                                      if v is cuda or isinstance(v, kernelapi.FakeCUDAModule))
        need = needs.get(id(fn))
        if need is None:
            need = needs[id(fn)] = bool(set(keys) & _global_names(fn.__code__, g))
        if not need:
            return fn(*args)
        if not refcount.get(gid):               # the first entry swaps the module, the last one restores it
            orig = {k: g[k] for k in keys if g[k] is cuda}
            saved[gid] = orig
            fake = kernel._kernel_context
            for k in orig:
                g[k] = fake
        refcount[gid] += 1
        try:
            return fn(*args)
        finally:
            refcount[gid] -= 1
            if refcount[gid] == 0:
                g.update(saved.pop(gid))
                del refcount[gid]

    kernel.FakeCUDAKernel.__call__ = call
    kernel.FakeCUDAKernel._ds4_fast_calls = True


def install():
    global _installed
    if _installed:
        return
    from numba.cuda.simulator import kernelapi
    for name in ("shfl_sync", "shfl_up_sync", "shfl_down_sync", "shfl_xor_sync", "ballot_sync", "all_sync",
                 "any_sync", "syncwarp", "activemask"):
        setattr(kernelapi.FakeCUDAModule, name, staticmethod(globals()[name]))
    lock_simulator_shared_arrays()
    fast_device_calls()
    if not block_scheduler_with_greenlets():
        block_scheduler_with_baton()
    _installed = True
