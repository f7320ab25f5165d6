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


def _statements(fn):
    """A function's top-level statements, its docstring left out."""
    body = fn.body
    if isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value,
                                                                                                   str):
        body = body[1:]
    return body


def _first_statement(fn):
    body = _statements(fn)
    return body[0] if body else None


def _is_entry(stmt):
    return (isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call)
            and ast.unparse(stmt.value) == "grid_entry_device()")


def _early_reads(path):
    """The module's EARLY_READS literal {kernel: (parameter, ...)} (kernels.pdl), {} when it has none."""
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and [ast.unparse(t) for t in node.targets] == ["EARLY_READS"]:
            return ast.literal_eval(node.value)
    return {}


def _params_before_entry(fn):
    """(whether the body has a top-level grid_entry_device(), the kernel's parameters that the statements before it
    use other than through `.shape`)."""
    params = {a.arg for a in fn.args.args}
    body = _statements(fn)
    at = next((i for i, stmt in enumerate(body) if _is_entry(stmt)), None)
    if at is None:
        return False, set()
    shapes = {id(n.value) for stmt in body[:at] for n in ast.walk(stmt)
              if isinstance(n, ast.Attribute) and n.attr == "shape" and isinstance(n.value, ast.Name)}
    used = {n.id for stmt in body[:at] for n in ast.walk(stmt)
            if isinstance(n, ast.Name) and n.id in params and id(n) not in shapes}
    return True, used


def _entry_problems(path):
    """Kernels of the file breaking the rule below, with why."""
    early = _early_reads(path)
    bad = []
    for fn in _kernels(path):
        if fn.name not in early:
            if not _is_entry(_first_statement(fn)):
                bad.append(f"{fn.name}: does not begin with grid_entry_device()")
            continue
        found, used = _params_before_entry(fn)
        if not found:
            bad.append(f"{fn.name}: no grid_entry_device() among its top-level statements")
        elif used - set(early[fn.name]):
            bad.append(f"{fn.name}: uses {sorted(used - set(early[fn.name]))} before grid_entry_device()")
    return bad


KERNEL_FILES = sorted(p for p in (ROOT / "kernels").glob("*.py") if _kernels(p))


@pytest.mark.parametrize("path", KERNEL_FILES, ids=lambda p: p.stem)
def test_every_kernel_begins_with_the_grid_entry(path):
    """A kernel that touched memory before the entry's wait could read a predecessor's output early once its graph
    edge is programmatic: the entry is each kernel's first statement, except in the kernels a module lists in
    EARLY_READS, whose statements before it may use only the parameters listed there (data no kernel of a step
    writes: weights, codebooks; and scalars), other parameters through `.shape` alone."""
    bad = _entry_problems(path)
    assert not bad, f"kernels.{path.stem}: {bad}"


def test_the_early_kernels_are_listed():
    """The kernels that read weights before the entry (kernels.pdl) are the ones listed, and each list names a real
    parameter of its kernel."""
    listed = {p.stem: early for p in KERNEL_FILES if (early := _early_reads(p))}
    assert listed == {"q4k_gemv": {"q4k_mma_kernel": ("w1", "n_words", "sps"),
                                   "q4k_imma_kernel": ("w1", "n_words", "rows_per_group", "kx")},
                      "q4k_dp4a": {"q4k_dp_kernel": ("w4", "n_words4", "rows_per_group")},
                      "vq_gemv": {"vq_gemv_kernel": ("cb_g",)},
                      "hc": {"hc_mix_partial_kernel": ("fn", "cols"), "hc_mix_fused_kernel": ("fn", "cols")}}
    for stem, early in listed.items():
        fns = {fn.name: fn for fn in _kernels(ROOT / "kernels" / f"{stem}.py")}
        for name, params in early.items():
            assert set(params) <= {a.arg for a in fns[name].args.args}, (stem, name)


def test_an_early_kernel_reading_another_parameter_is_caught(tmp_path):
    src = tmp_path / "k.py"
    src.write_text('from numba import cuda\n\nEARLY_READS = {"k": ("w",)}\n\n\n@cuda.jit(cache=True)\n'
                   'def k(w, x, out):\n    """doc."""\n    n = out.shape[0]\n    a = w[0] + x[n]\n'
                   '    grid_entry_device()\n    out[0] = a\n')
    assert _entry_problems(src) == ["k: uses ['x'] before grid_entry_device()"]
    src.write_text(src.read_text().replace(" + x[n]", ""))
    assert _entry_problems(src) == []
    src.write_text(src.read_text().replace("    grid_entry_device()\n", ""))
    assert _entry_problems(src) == ["k: no grid_entry_device() among its top-level statements"]


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


def test_the_ptx_rule_of_early_kernels():
    """compile_sm90.entry_first: a load above the wait fails a kernel but for an early one, whose shared-memory
    stores pass too; a global store or atomic above the wait fails both."""
    from tests.kernels.compile_sm90 import entry_first
    head = ".visible .entry k(\n.param .u64 p\n)\n{\n\tld.param.u64 %rd1, [p];\n"
    tail = "\tgriddepcontrol.wait;\n\tgriddepcontrol.launch_dependents;\n\tst.global.f32 [%rd2], %f1;\n\tret;\n}\n"
    load = "\tld.global.u64 %rd2, [%rd1];\n\tst.shared.u64 [%r1], %rd2;\n"
    assert entry_first(head + tail) and entry_first(head + tail, early=True)
    assert not entry_first(head + load + tail) and entry_first(head + load + tail, early=True)
    for write in ("\tst.global.u64 [%rd1], %rd2;\n", "\tatom.global.add.u32 %r2, [%rd1], 1;\n",
                  "\tst.u64 [%rd1], %rd2;\n"):
        assert not entry_first(head + write + tail, early=True), write
