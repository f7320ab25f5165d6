"""CUDA graphs for the CUDA backend: capture the launches a Python callable makes on a Numba stream, replay them.

Owns `StepGraph`: `StepGraph.capture(stream, run)` records every launch `run()` issues on `stream` (nothing executes
while capturing) through the CUDA runtime of `cuda.bindings`, instantiates the graph and keeps it; `launch()`
replays it on the same stream (~1 µs per kernel node instead of Numba's ~17 µs eager launch); `nodes` counts its
kernel and copy nodes; with `programmatic=True` every edge from a kernel node to a kernel node becomes a
programmatic one before instantiation (`programmatic_edges`, counted in `pdl_edges`): the dependent kernel may be
launched once every block of its predecessor has passed kernels.pdl's entry, and its own entry waits for the
predecessor to complete, so its blocks are resident when it does. Only kernels that begin with that entry (every
kernel of `kernels/`) may be captured that way. If the runtime refuses the edges the graph is captured again with
default edges, with a warning; `mapped(shape, dtype)`: host-mapped memory the host writes a replayed graph's inputs
into and its kernels read (`Mapped.host`, `Mapped.dev`). The caller keeps every device array the graph reads or
writes alive for as long as the graph lives (`keep`), since a graph holds raw pointers. Capture uses the relaxed
mode so that a launcher that happens to allocate a scratch array during capture still works; the backend warms every
shape eagerly first, so none does in steady state. Not available under the CUDA simulator (no graphs there):
`available()` says so.

Stream priorities: `priority_range()` is the device's (lowest, highest) stream priority (CUDA counts down: the
highest is the smallest number); `priority_stream(p)` a new Numba stream at priority p (destroyed with the object);
`StepGraph.capture(..., node_priority=True)` instantiates the graph so that each kernel node runs at the priority
captured from the stream that launched it (cudaGraphInstantiateFlagUseNodePriority), not at the launch stream's.
"""
from __future__ import annotations

import warnings

__all__ = ["StepGraph", "Mapped", "available", "mapped", "programmatic_edges", "priority_range", "priority_stream"]


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


def priority_range():
    """(lowest, highest) stream priority of the current device (e.g. (0, -5): a smaller number runs first)."""
    least, greatest = _check(_rt().cudaDeviceGetStreamPriorityRange(), "stream priority range")
    return int(least), int(greatest)


def priority_stream(priority):
    """A Numba stream over a new CUDA stream at `priority` (clamped by the driver into the device's range), destroyed
    when the returned object is collected. Default flags, as `cuda.stream()`'s: it synchronises with the legacy
    default stream, so copies made there without a stream stay ordered before its kernels."""
    import weakref

    from numba import cuda
    rt = _rt()
    handle = _check(rt.cudaStreamCreateWithPriority(rt.cudaStreamDefault, int(priority)), "stream creation")
    stream = cuda.external_stream(int(handle))
    weakref.finalize(stream, rt.cudaStreamDestroy, handle)
    return stream


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


def programmatic_edges(edges, is_kernel):
    """The indices of the edges to make programmatic: `edges` [(from, to, default)] (node keys, and whether the
    edge has default data), `is_kernel(key)`: both ends kernel nodes, the edge a default one."""
    return [i for i, (a, b, default) in enumerate(edges) if default and is_kernel(a) and is_kernel(b)]


def _edges(rt, graph):
    """[(from node, to node, edge data)] of a graph."""
    got = _check(rt.cudaGraphGetEdges(graph, 0), "edge count")
    n = int(got[-1])
    if n == 0:
        return []
    frm, to, data, n = _check(rt.cudaGraphGetEdges(graph, n), "edges")
    return list(zip(frm[:n], to[:n], data[:n]))


def _make_programmatic(rt, graph) -> int:
    """Turn the graph's default kernel-to-kernel edges into programmatic ones (module docstring); -> their count."""
    kernel = rt.cudaGraphNodeType.cudaGraphNodeTypeKernel
    default = rt.cudaGraphDependencyType.cudaGraphDependencyTypeDefault
    edges = _edges(rt, graph)
    kinds = {}
    for a, b, _ in edges:
        for node in (a, b):
            if int(node) not in kinds:
                kinds[int(node)] = _check(rt.cudaGraphNodeGetType(node), "node type") == kernel
    keyed = [(int(a), int(b), d.type == default and d.from_port == 0 and d.to_port == 0) for a, b, d in edges]
    pick = programmatic_edges(keyed, kinds.__getitem__)
    prog = rt.cudaGraphEdgeData()
    prog.from_port = rt.cudaGraphKernelNodePortProgrammatic
    prog.to_port = 0
    prog.type = rt.cudaGraphDependencyType.cudaGraphDependencyTypeProgrammatic
    for i in pick:
        a, b, d = edges[i]
        _check(rt.cudaGraphRemoveDependencies(graph, [a], [b], [d], 1), "edge removal")
        _check(rt.cudaGraphAddDependencies(graph, [a], [b], [prog], 1), "programmatic edge")
    return len(pick)


class StepGraph:
    def __init__(self, graph, exe, stream, nodes, keep, pdl_edges=0):
        self._graph, self._exe, self.stream, self.nodes, self.keep = graph, exe, stream, nodes, keep
        self.pdl_edges = pdl_edges

    @staticmethod
    def _record(rt, stream, run):
        h = _handle(stream)
        _check(rt.cudaStreamBeginCapture(h, rt.cudaStreamCaptureMode.cudaStreamCaptureModeRelaxed), "begin capture")
        try:
            run()
        finally:
            graph = _check(rt.cudaStreamEndCapture(h), "end capture")
        return graph

    @classmethod
    def capture(cls, stream, run, keep=(), programmatic=False, node_priority=False):
        rt = _rt()
        graph = cls._record(rt, stream, run)
        pdl = 0
        if programmatic:
            try:
                pdl = _make_programmatic(rt, graph)
            except Exception as e:  # noqa: BLE001 - a runtime without programmatic edges costs speed, not a token
                rt.cudaGraphDestroy(graph)           # edges may be half rewritten: record the launches again
                warnings.warn(f"programmatic graph edges refused ({type(e).__name__}: {e}); default edges kept")
                graph, pdl = cls._record(rt, stream, run), 0
        try:
            got = _check(rt.cudaGraphGetNodes(graph, 0), "node count")
            nodes = int(got[-1] if isinstance(got, tuple) else got)
        except Exception:  # noqa: BLE001 - the count is informative only
            nodes = -1
        flags = int(rt.cudaGraphInstantiateFlags.cudaGraphInstantiateFlagUseNodePriority) if node_priority else 0
        exe = _check(rt.cudaGraphInstantiate(graph, flags), "instantiate")
        return cls(graph, exe, stream, nodes, list(keep), pdl)

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
