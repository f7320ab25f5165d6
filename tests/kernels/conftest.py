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


def put_fp8_on_mma(monkeypatch):
    """Put every FP8-grid q4_K GEMV (quantize=True or fp8_input=True) back on the FP8 tensor-core path
    (q4k_mma_kernel) and with it the norm in its staging (norm_path): kernels.q4k_gemv.IM_FP8_MIN_ROWS and
    IM_FP8_MIN_SB raised past any shape, where the defaults (0) send every such call to the integer path. For the
    tests of that path and of the fusions that ride on it; a plain function, so that tests/engine, which does not see
    this file's fixtures, can call it too."""
    import kernels.q4k_gemv as qk
    monkeypatch.setattr(qk, "IM_FP8_MIN_ROWS", 1 << 30)
    monkeypatch.setattr(qk, "IM_FP8_MIN_SB", 1 << 30)


@pytest.fixture
def fp8_on_mma(monkeypatch):
    """put_fp8_on_mma for the test that asks for it (undone after it)."""
    put_fp8_on_mma(monkeypatch)
