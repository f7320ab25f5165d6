"""A compile-time fix to numba-cuda's lowering, installed by kernels/__init__.py before any kernel compiles.

Before it lowers a function to LLVM IR, numba-cuda 0.30's `Lower._find_singly_assigned_variable` picks the
variables that may live in SSA values instead of stack slots: those defined in exactly one block, not used outside
it, not forced onto the stack, and assigned exactly once in that block. For the last condition it lists every
assignment of the block again for each candidate, so a block of n statements costs about n^2 steps. When our
kernels had numba inline whole trees of device functions (`inline=True`; NVVM inlines them now, kernels.inline_device)
their blocks held thousands of statements: compiling q4k_dp_t1s_kernel for sm_90 took 102 s on the 2-core dev box,
57 s of them in that scan.

`singly_assigned(lower)` finds the same set with one count of each block's assignment targets (a block is
counted once, when its first candidate is checked), so the same variables are lowered the same way and the PTX does
not change (tests/kernels/test_numba_fix.py compares the two sets while compiling kernels). `install()` puts it in
place only for the numba-cuda versions it was checked against (CHECKED); any other version keeps its own method.
"""
from collections import Counter

__all__ = ["CHECKED", "install", "installed", "singly_assigned"]

CHECKED = ("0.30.4",)          # numba-cuda versions whose Lower this was read against and tested with


def singly_assigned(lower):
    """The set `Lower._find_singly_assigned_variable` computes, for the Lower instance `lower`."""
    from numba.cuda.core import ir
    from numba.cuda.core.analysis import compute_use_defs, must_use_alloca
    blocks = lower.func_ir.blocks
    if lower.func_ir.func_id.is_generator:
        return set()
    use_defs = compute_use_defs(blocks)
    on_stack = must_use_alloca(blocks)
    def_blocks, used_in = {}, set()
    for label, names in use_defs.defmap.items():
        for name in names:
            def_blocks.setdefault(name, set()).add(label)
    for names in use_defs.usemap.values():      # uses before a local definition: the variable crosses blocks
        used_in.update(names)
    counts = {}
    out = set()
    for name, labels in def_blocks.items():
        if name in on_stack or len(labels) != 1 or name in used_in:
            continue
        (label,) = labels
        if label not in counts:
            counts[label] = Counter(st.target.name for st in lower.blocks[label].find_insts(ir.assign_types))
        if counts[label][name] == 1:
            out.add(name)
    return out


def installed():
    """Whether Lower uses singly_assigned (install() ran on a CHECKED version)."""
    from numba.cuda import lowering
    return getattr(lowering.Lower._find_singly_assigned_variable, "_ds4_fix", False)


def install():
    """Replace Lower._find_singly_assigned_variable by singly_assigned on a CHECKED numba-cuda (idempotent)."""
    from importlib.metadata import PackageNotFoundError, version
    try:
        if version("numba-cuda") not in CHECKED:
            return
    except PackageNotFoundError:
        return
    from numba.cuda import lowering
    if installed():
        return

    def _find_singly_assigned_variable(self):
        self._singly_assigned_vars = singly_assigned(self)
        self._blk_local_varmap = {}
    _find_singly_assigned_variable._ds4_fix = True
    lowering.Lower._find_singly_assigned_variable = _find_singly_assigned_variable
