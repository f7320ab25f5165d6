"""Input errors on the `ds4` command lines: a one-line message naming the problem, exit status 2, no traceback.
Each case fails before any model is loaded, so no stack is needed (the -m file does not even exist)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
M = ["-m", "no-such-base.gguf"]


def _ds4(*args):
    return subprocess.run([sys.executable, "-m", "ds4lib.tools.cli", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)


@pytest.mark.parametrize("args,message", [
    ([*M, "-p", "hi", "--seed", "-1"], "argument --seed: -1 is below the minimum of 0"),
    ([*M, "-p", "hi", "--seed", str(1 << 64)], "64-bit seed"),
    ([*M, "-p", "hi", "--temp", "nan"], "argument --temp: 'nan' is not a finite number"),
    ([*M, "-p", "hi", "--top-p", "0"], "argument --top-p: 0.0 is outside (0.0, 1.0]"),
    ([*M, "-p", "hi", "-n", "0"], "argument -n/--max-tokens: 0 is below the minimum of 1"),
    ([*M, "-p", "hi", "--top-k", "two"], "argument --top-k: 'two' is not an integer"),
    ([*M, "-p", "hi", "--mem-budget-mb", "inf"], "argument --mem-budget-mb"),
    (["eval", *M, "--slice", "data/slices/code/judge.json"], "did you mean code/judge?"),
    (["eval", *M, "--slice", "finance"], "is not a slice name: give DOMAIN/ROLE"),
    (["eval", *M, "--slice", "finance/nothing"], "no slice 'finance/nothing'"),
    (["eval", *M, "--windows-file", "no-such-windows.npy"], "no-such-windows.npy"),
    (["eval", *M, "--slice", "finance/judge", "--windows", "0"], "argument --windows: 0 is below the minimum"),
    (["score", *M, "--tokens", "1,x"], "give integer token ids"),
    (["score", *M, "--tokens", "1,2", "--score-split", "-3"], "argument --score-split"),
    (["quantize", "--checkpoint", "nowhere", "--out", "x.gguf", "--rounds", "0"], "argument --rounds"),
    ([*M, "-p", "hi"], "no-such-base.gguf"),
])
def test_input_errors_are_one_message_without_traceback(args, message):
    r = _ds4(*args)
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert message in r.stderr + r.stdout and "Traceback" not in r.stderr, r.stderr


def test_generation_help_names_every_subcommand():
    from ds4lib.tools.cli import SUBCOMMANDS
    from ds4lib.tools.generate import build_parser
    text = " ".join(build_parser().format_help().split())
    for name in SUBCOMMANDS:
        assert f" {name} " in text.replace(")", " ").replace("|", " ")
