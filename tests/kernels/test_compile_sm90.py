"""Every kernel compiles for sm_90 (Hopper) on a machine without a GPU."""
from tests.kernels.compile_sm90 import all_kernels, compile_all


def test_all_kernels_compile_for_sm90():
    """Every kernel of every SIGNATURES table, compiled by two child processes fed from one queue (the suite runs on
    2 cores; compiling is most of this test's time). The PTX stays in the session for the tests that inspect it
    (compile_sm90.ptx_counts). Each kernel's PTX runs kernels.pdl's entry (grid-dependency wait, then trigger) before
    its first memory access (compile_sm90.entry_first)."""
    rows, returncodes = compile_all(workers=2)
    failed = [r for r in rows if not r["ok"]]
    assert rows, "no kernel was compiled"
    assert not failed, failed
    assert returncodes == [0, 0], returncodes
    want = sorted((m, k) for m, k, _ in all_kernels())
    assert sorted((r["module"], r["kernel"]) for r in rows) == want          # each kernel once, none left out
    no_entry = [f"{r['module']}:{r['kernel']}" for r in rows if not r["entry_first"]]
    assert not no_entry, f"kernels whose PTX does not begin with kernels.pdl's entry: {no_entry}"
    names = {r["kernel"] for r in rows}
    assert "rms_norm_kernel" in names
    assert next(r for r in rows if r["kernel"] == "rms_norm_kernel")["shfl"]
