"""Kernel timing shared by the bench scripts: eager launches timed with CUDA events, and the same calls replayed
from a CUDA graph (captured through cuda.bindings; launch cost ~0.9 µs instead of numba's ~17+ µs); and
`use_simulator()`, which a script calls for its --small runs before it first imports numba.cuda (this module
imports numba only inside its functions for that reason)."""
import os
import sys
import time

__all__ = ["graph_time", "eager_time", "probe_time", "empty_node", "use_simulator"]


def use_simulator():
    """Run every later numba.cuda import under the CUDA simulator, with the tests' warp-intrinsic shim."""
    os.environ["NUMBA_ENABLE_CUDASIM"] = "1"
    sys.setswitchinterval(1e-4)
    from tests.kernels.cudasim_shim import install
    install()


_EMPTY = []


def empty_node(threads, stream):
    """Launch a kernel of one block of `threads` that does nothing: a dev probe's `empty` form, the cost of a graph
    node alone, which it subtracts from the others."""
    if not _EMPTY:
        from numba import cuda

        @cuda.jit
        def empty_kernel():
            pass
        _EMPTY.append(empty_kernel)
    _EMPTY[0][1, threads, stream]()


def _stream_handle(stream):
    h = stream.handle
    return int(getattr(h, "value", h))


def graph_time(run, stream, reps):
    """Per-call seconds of `run` replayed from a CUDA graph of `reps` captured calls."""
    from cuda.bindings import runtime as rt
    from numba import cuda
    h = _stream_handle(stream)

    def check(res):
        err = res[0] if isinstance(res, tuple) else res
        if int(err) != 0:
            raise RuntimeError(f"CUDA runtime error {err}")
        return res[1] if isinstance(res, tuple) and len(res) > 1 else None

    check(rt.cudaStreamBeginCapture(h, rt.cudaStreamCaptureMode.cudaStreamCaptureModeThreadLocal))
    try:
        for _ in range(reps):
            run()
    finally:
        graph = check(rt.cudaStreamEndCapture(h))
    exe = check(rt.cudaGraphInstantiate(graph, 0))
    check(rt.cudaGraphLaunch(exe, h))                   # warm
    stream.synchronize()
    start, end = cuda.event(), cuda.event()
    start.record(stream)
    check(rt.cudaGraphLaunch(exe, h))
    end.record(stream)
    end.synchronize()
    check(rt.cudaGraphExecDestroy(exe))
    check(rt.cudaGraphDestroy(graph))
    return cuda.event_elapsed_time(start, end) / 1e3 / reps


def probe_time(run, stream, eager, calls, copies):
    """A dev probe's (bench/dev) timing of `run`: one call first (it compiles and warms), then with `eager` `calls`
    (at least one) eager calls for a profiler and (calls, None); else (reps, µs a call) replayed from a CUDA graph of
    reps = calls, or enough captured calls to cycle the probe's `copies` of its cold operands 4 times (40 at least)."""
    run()
    stream.synchronize()
    if eager:
        for _ in range(max(calls, 1)):
            run()
        stream.synchronize()
        return calls, None
    reps = calls or max(copies * 4, 40)
    return reps, graph_time(run, stream, reps) * 1e6


def eager_time(run, stream, reps, simulator=False):
    """Per-call seconds of `reps` eager calls (CUDA events); under the simulator one call by the wall clock."""
    from numba import cuda
    if simulator:
        t = time.perf_counter()
        run()
        cuda.synchronize()
        return time.perf_counter() - t
    start, end = cuda.event(), cuda.event()
    start.record(stream)
    for _ in range(reps):
        run()
    end.record(stream)
    end.synchronize()
    return cuda.event_elapsed_time(start, end) / 1e3 / reps
