"""Kernel tests run three ways: under the CUDA simulator (CI), compiled for sm_90 without a GPU
(test_compile_sm90.py, in a subprocess), and on a real GPU with DS4_REQUIRE_CUDA=1, where a skipped
CUDA test is an error. A test that only the simulator can run (it records device calls through a Python stand-in,
or tests the simulator's shim) is marked `simulator`: outside the simulator it is deselected, never skipped, so that
a GPU run of its file still holds every other test to running."""
import os

import pytest

REQUIRE_CUDA = os.environ.get("DS4_REQUIRE_CUDA", "0") not in ("", "0")
SIMULATOR = os.environ.get("NUMBA_ENABLE_CUDASIM", "0") not in ("", "0")

if SIMULATOR:
    from tests.kernels.cudasim_shim import install
    install()


def pytest_collection_modifyitems(config, items):
    if SIMULATOR:
        return
    sim_only = [item for item in items if item.get_closest_marker("simulator")]
    if sim_only:
        config.hook.pytest_deselected(items=sim_only)
        items[:] = [item for item in items if not item.get_closest_marker("simulator")]


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
