"""kernels.pdl: every kernel of `kernels/` begins with the grid-dependency entry, and the CUDA graphs make only
kernel-to-kernel edges programmatic (ds4lib.engine.cuda_graph). The PTX side (the entry before any memory access, in
every kernel of every SIGNATURES table) is tests/kernels/test_compile_sm90.py's; graph == eager with programmatic
edges on the GPU is tests/engine/test_engine_cuda.py's."""
import ast
from pathlib import Path

import pytest

from ds4lib.engine.cuda_graph import programmatic_edges

ROOT = Path(__file__).resolve().parents[2]


def _is_kernel_decorator(d):
    """@cuda.jit(...) without device=True, @bounded_jit(...), bare @cuda.jit, or @jit (a factory's local
    cuda.jit(...) or bounded_jit(...))."""
    if isinstance(d, ast.Call):
        if ast.unparse(d.func) == "bounded_jit":
            return True
        if ast.unparse(d.func) != "cuda.jit":
            return False
        return not any(kw.arg == "device" and isinstance(kw.value, ast.Constant) and kw.value.value
                       for kw in d.keywords)
    return ast.unparse(d) in ("cuda.jit", "jit")


def _kernels(path):
    tree = ast.parse(path.read_text())
    return [n for n in ast.walk(tree)
            if isinstance(n, ast.FunctionDef) and any(_is_kernel_decorator(d) for d in n.decorator_list)]


def _first_statement(fn):
    body = fn.body
    if isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value,
                                                                                                   str):
        body = body[1:]
    return body[0] if body else None


KERNEL_FILES = sorted(p for p in (ROOT / "kernels").glob("*.py") if _kernels(p))


@pytest.mark.parametrize("path", KERNEL_FILES, ids=lambda p: p.stem)
def test_every_kernel_begins_with_the_grid_entry(path):
    """A kernel that touched memory before the entry's wait could read a predecessor's output early once its graph
    edge is programmatic: the entry is each kernel's first statement."""
    bad = []
    for fn in _kernels(path):
        first = _first_statement(fn)
        if not (isinstance(first, ast.Expr) and isinstance(first.value, ast.Call)
                and ast.unparse(first.value) == "grid_entry_device()"):
            bad.append(fn.name)
    assert not bad, f"kernels.{path.stem}: kernels not beginning with grid_entry_device(): {bad}"


def test_the_check_sees_every_kernel_module():
    names = {p.stem for p in KERNEL_FILES}
    assert {"attention", "q4k_gemv", "vq_gemv", "rms_norm", "hc", "moe", "sampling"} <= names
    assert sum(len(_kernels(p)) for p in KERNEL_FILES) >= 70


def test_a_kernel_without_the_entry_is_caught(tmp_path):
    src = tmp_path / "k.py"
    src.write_text('from numba import cuda\n\n\n@cuda.jit(cache=True)\ndef k(a):\n    """doc."""\n    a[0] = 1\n\n\n'
                   '@cuda.jit(device=True)\ndef d(a):\n    return a[0]\n')
    ks = _kernels(src)
    assert [k.name for k in ks] == ["k"]                  # device functions are not kernels
    assert ast.unparse(_first_statement(ks[0])) == "a[0] = 1"


def test_only_default_kernel_to_kernel_edges_become_programmatic():
    kinds = {"k1": True, "k2": True, "k3": True, "copy": False}
    edges = [("k1", "k2", True),        # kernel -> kernel: converted
             ("copy", "k1", True),      # a copy node's edge stays
             ("k2", "copy", True),
             ("k2", "k3", False),       # already carrying edge data: left as it is
             ("k1", "k3", True)]        # a join's second edge: converted too
    assert programmatic_edges(edges, kinds.__getitem__) == [0, 4]
    assert programmatic_edges([], kinds.__getitem__) == []
