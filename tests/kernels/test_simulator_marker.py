"""tests/kernels/conftest.py's `simulator` marker: outside the simulator such a test is deselected, not skipped, so
that a GPU run with DS4_REQUIRE_CUDA=1 (where a skip is an error) can take a file that holds one."""
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _pytest(tmp_path, simulator):
    (tmp_path / "test_marked.py").write_text(
        "import pytest\n\n\n@pytest.mark.simulator\ndef test_sim_only():\n    pass\n\n\n"
        "def test_everywhere():\n    pass\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"}      # the child's pytest: its own options
    env.update(DS4_REQUIRE_CUDA="1", NUMBA_ENABLE_CUDASIM="1" if simulator else "0", PYTHONPATH=str(ROOT))
    # the test file sits beside a copy of the conftest under test, so that its hooks apply
    (tmp_path / "conftest.py").write_text((ROOT / "tests" / "kernels" / "conftest.py").read_text())
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rA",
                           str(tmp_path / "test_marked.py")], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)


def test_outside_the_simulator_a_marked_test_is_deselected_not_skipped(tmp_path):
    r = _pytest(tmp_path, simulator=False)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "1 passed, 1 deselected" in r.stdout and "PASSED test_marked.py::test_everywhere" in r.stdout


def test_in_the_simulator_a_marked_test_runs(tmp_path):
    r = _pytest(tmp_path, simulator=True)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "2 passed" in r.stdout and "deselected" not in r.stdout
