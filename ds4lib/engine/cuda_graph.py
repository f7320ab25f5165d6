"""CUDA graphs for the CUDA backend: capture the launches a Python callable makes on a Numba stream, replay them.

Owns `StepGraph`: `StepGraph.capture(stream, run)` records every launch `run()` issues on `stream` (nothing executes
while capturing) through the CUDA runtime of `cuda.bindings`, instantiates the graph and keeps it; `launch()`
replays it on the same stream (~1 µs per kernel node instead of Numba's ~17 µs eager launch); `nodes` counts its
kernel and copy nodes; `mapped(shape, dtype)`: host-mapped memory the host writes a replayed graph's inputs into and
its kernels read (`Mapped.host`, `Mapped.dev`). The caller keeps every device array the graph reads or writes alive
for as long as the graph lives (`keep`), since a graph holds raw pointers. Capture uses the relaxed mode so that a
launcher that happens to allocate a scratch array during capture still works; the backend warms every shape eagerly
first, so none does in steady state. Not available under the CUDA simulator (no graphs there): `available()` says
so.
"""
from __future__ import annotations

__all__ = ["StepGraph", "Mapped", "available", "mapped"]


class Mapped:
    """Host-mapped memory: `host` (written by the host) and `dev` (a device array over the same bytes, read by
    kernels; numba's mapped arrays cannot be re-viewed as device arrays directly)."""

    def __init__(self, host, dev):
        self.host, self.dev = host, dev


def mapped(shape, dtype) -> Mapped:
    from numba import cuda
    from numba.cuda.core import config
    host = cuda.mapped_array(shape, dtype)
    if not config.ENABLE_CUDASIM:
        from numba.cuda.cudadrv.devicearray import DeviceNDArray
        return Mapped(host, DeviceNDArray(host.shape, host.strides, host.dtype, gpu_data=host.gpu_data))
    return Mapped(host, host)


def _rt():
    from cuda.bindings import runtime as rt
    return rt


def available() -> bool:
    from numba.cuda.core import config
    if config.ENABLE_CUDASIM:
        return False
    try:
        _rt()
    except ImportError:
        return False
    return True


def _check(res, what):
    err = res[0] if isinstance(res, tuple) else res
    if int(err) != 0:
        raise RuntimeError(f"CUDA graph {what} failed: {err}")
    if isinstance(res, tuple):
        return res[1] if len(res) == 2 else res[1:]
    return None


def _handle(stream):
    h = stream.handle
    return int(getattr(h, "value", h))


class StepGraph:
    def __init__(self, graph, exe, stream, nodes, keep):
        self._graph, self._exe, self.stream, self.nodes, self.keep = graph, exe, stream, nodes, keep

    @classmethod
    def capture(cls, stream, run, keep=()):
        rt = _rt()
        h = _handle(stream)
        _check(rt.cudaStreamBeginCapture(h, rt.cudaStreamCaptureMode.cudaStreamCaptureModeRelaxed), "begin capture")
        try:
            run()
        finally:
            graph = _check(rt.cudaStreamEndCapture(h), "end capture")
        try:
            got = _check(rt.cudaGraphGetNodes(graph, 0), "node count")
            nodes = int(got[-1] if isinstance(got, tuple) else got)
        except Exception:  # noqa: BLE001 - the count is informative only
            nodes = -1
        exe = _check(rt.cudaGraphInstantiate(graph, 0), "instantiate")
        return cls(graph, exe, stream, nodes, list(keep))

    def launch(self):
        _check(_rt().cudaGraphLaunch(self._exe, _handle(self.stream)), "launch")

    def close(self):
        if self._exe is not None:
            rt = _rt()
            rt.cudaGraphExecDestroy(self._exe)
            rt.cudaGraphDestroy(self._graph)
            self._exe = self._graph = None
            self.keep = []

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown: the driver may be gone
            pass
