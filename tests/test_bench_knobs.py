"""bench/dev/knobs.py: the statements run first, then the script as __main__ with the arguments after --; a call
without -- or with another flag is refused with its usage line."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(*args):
    return subprocess.run([sys.executable, "bench/dev/knobs.py", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)


def test_the_knob_is_set_before_the_script_runs(tmp_path):
    script = tmp_path / "show.py"
    script.write_text("import sys\nimport kernels.attention as a\nprint(__name__, a.SCORE_BLOCKS, sys.argv[1:])\n")
    r = _run("--exec", "import kernels.attention as a; a.SCORE_BLOCKS = 77", "--exec", "print('first')", "--",
             str(script), "--x", "1")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split("\n")[:2] == ["first", "__main__ 77 ['--x', '1']"]


def test_bad_calls_are_refused_with_the_usage():
    for args in (("--exec", "pass"), ("--set", "x", "--", "s.py"), ("--exec", "pass", "--")):
        r = _run(*args)
        assert r.returncode != 0 and "knobs.py: --exec STATEMENT ... -- SCRIPT [ARGS]" in r.stderr, args
