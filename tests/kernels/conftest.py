"""Kernel tests run three ways: under the CUDA simulator (CI), compiled for sm_90 without a GPU
(test_compile_sm90.py, in a subprocess), and on a real GPU with DS4_REQUIRE_CUDA=1, where a skipped
CUDA test is an error."""
import os

import pytest

REQUIRE_CUDA = os.environ.get("DS4_REQUIRE_CUDA", "0") not in ("", "0")
SIMULATOR = os.environ.get("NUMBA_ENABLE_CUDASIM", "0") not in ("", "0")

if SIMULATOR:
    from tests.kernels.cudasim_shim import install
    install()


def pytest_runtest_makereport(item, call):
    if REQUIRE_CUDA and call.excinfo is not None and call.excinfo.errisinstance(pytest.skip.Exception):
        raise RuntimeError(f"{item.nodeid} was skipped but DS4_REQUIRE_CUDA=1 requires every CUDA test to run")


@pytest.fixture(scope="session")
def cuda_ready():
    """The numba.cuda module, real or simulated; fails (never skips) when a GPU is required and absent."""
    from numba import cuda
    if REQUIRE_CUDA and (SIMULATOR or not cuda.is_available()):
        raise RuntimeError("DS4_REQUIRE_CUDA=1 but no real CUDA device is usable")
    return cuda
