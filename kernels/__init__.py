"""Numba CUDA kernels of ds4: one op family per module, each with `<op>_kernel`(s), UPPER_CASE compile-time
constants, a host launcher `<op>(...)` (validates, sizes the grid, launches; no math of its own) and
`SIGNATURES` {kernel name: Numba signature} compiled for sm_90 by the tests.

Kernels import numpy, numba and ds4lib.formats constants only; no I/O and no model objects.
"""
import numpy as _np

# numba-cuda 0.30 registers np.row_stack, which numpy 2.5 removed (docs/toolchain.md §4.1): restore the alias
# before anything compiles. Done here, once, for every kernel module.
if not hasattr(_np, "row_stack"):
    _np.row_stack = _np.vstack

# Decode launches grids of a few blocks by design (one token, a handful of experts); numba-cuda warns about every
# grid under 128 blocks, which floods the CLI's stderr. Turned off here unless the user asked for it.
import os as _os

if "NUMBA_CUDA_LOW_OCCUPANCY_WARNINGS" not in _os.environ:
    from numba.cuda.core import config as _cuda_config
    _cuda_config.CUDA_LOW_OCCUPANCY_WARNINGS = 0
