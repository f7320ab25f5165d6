"""bench/dev/critical_path.py: the chain inferred backwards through a timeline (a side stream's kernel on it, a main
stream's kernel beside it off it), the report's sums a step, and the command line's output and refusals."""
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("critical_path", ROOT / "bench" / "dev" / "critical_path.py")
cp = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cp)


def _row(kernel, start, dur, stream, grid=(1, 1, 1), context=1024):
    """A row as bench_v41_decode.py's timeline_rows writes it (grid and block as "A,B,C")."""
    return {"context": context, "kernel": kernel, "op": "x", "grid": ",".join(map(str, grid)), "block": "128,1,1",
            "stream": stream, "start_us": start, "dur_us": dur}


# main: norm 0-10, then route 12-20 (it does not hold the join); side: shared 10.5-30; main waits for it: post 31-40;
# and a second step of the same shape 50 µs later
STEP = [_row("norm", 0, 10, 7), _row("route", 12, 8, 7), _row("shared", 10.5, 19.5, 9, (288, 1, 1)),
        _row("post", 31, 9, 7)]
ROWS = STEP + [{**r, "start_us": r["start_us"] + 50} for r in STEP]


def test_the_chain_runs_through_the_side_stream_that_held_the_join():
    got = [(r["kernel"], r["start_us"]) for r in cp.chain(ROWS)]
    # post (81) waited for shared (ends 80), shared started after norm (ends 60); norm (50) after post (ends 40)
    assert got == [("norm", 0), ("shared", 10.5), ("post", 31), ("norm", 50), ("shared", 60.5), ("post", 81)]
    assert cp.chain([]) == []


def test_the_report_gives_each_kernels_chain_time_a_step():
    rep = cp.report(ROWS, steps=2)
    assert rep["span_us"] == 45.0                         # 0 .. 90 over 2 steps
    assert rep["chain_us"] == 38.5                        # 10 + 19.5 + 9
    assert rep["gap_us"] == 6.5                           # 0.5 + 1 a step, and 10 between the steps, halved
    # waits: shared 0.5 after norm, post 1 after shared, norm (second step) 10 after post: halved
    assert rep["kernels"] == [["shared", "288x1x1", 19.5, 19.5, 1.0, 1.0, 0.5],
                              ["norm", "1x1x1", 10.0, 10.0, 1.0, 1.0, 5.0],
                              ["post", "1x1x1", 9.0, 9.0, 1.0, 1.0, 1.0], ["route", "1x1x1", 0.0, 8.0, 0.0, 1.0, 0.0]]
    as_lists = [{**r, "grid": [int(v) for v in r["grid"].split(",")]} for r in ROWS]
    assert cp.report(as_lists, steps=2) == rep                # a grid given as a list reads the same


def test_a_start_within_the_slack_of_an_end_still_chains():
    rows = [_row("a", 0, 10, 1), _row("b", 9.8, 5, 2)]   # b's start read 0.2 µs before a's end
    assert [r["kernel"] for r in cp.chain(rows, slack_us=0.5)] == ["a", "b"]
    assert [r["kernel"] for r in cp.chain(rows, slack_us=0.0)] == ["b"]


def _run(*args):
    return subprocess.run([sys.executable, "bench/dev/critical_path.py", *map(str, args)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


def test_the_command_prints_the_table_and_writes_the_report(tmp_path):
    tl = tmp_path / "timeline.jsonl"
    tl.write_text("".join(json.dumps(r) + "\n" for r in ROWS + [_row("other", 0, 3, 7, context=65536)]))
    out = tmp_path / "rep.json"
    r = _run(tl, "--steps", 2, "--json", out)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[0] == ("context 1024: span 45.0 µs a step, 38.5 µs of it in chained kernels, "
                                        "6.5 µs in gaps between them")
    assert "shared" in r.stdout.splitlines()[2] and "other" not in r.stdout
    assert json.loads(out.read_text())["kernels"][0][:3] == ["shared", "288x1x1", 19.5]
    r = _run(tl, "--context", 65536, "--steps", 1)
    assert r.returncode == 0 and "other" in r.stdout


def test_bad_calls_are_refused(tmp_path):
    tl = tmp_path / "timeline.jsonl"
    tl.write_text(json.dumps(_row("a", 0, 1, 1)) + "\n")
    r = _run(tmp_path / "missing.jsonl")
    assert r.returncode != 0 and "critical_path:" in r.stderr and "missing.jsonl" in r.stderr
    r = _run(tl, "--context", 8)
    assert r.returncode != 0 and "no rows for context 8" in r.stderr
    r = _run(tl, "--steps", 0)
    assert r.returncode != 0 and "--steps must be at least 1" in r.stderr
    (tmp_path / "bad.jsonl").write_text("{not json\n")
    r = _run(tmp_path / "bad.jsonl")
    assert r.returncode != 0 and "bad.jsonl" in r.stderr
