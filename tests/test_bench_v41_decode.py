"""bench/bench_v41_decode.py --small runs the real-size decode benchmark's whole path under the simulator (micro model,
one eager step: the simulator has no graphs), so the benchmark cannot rot."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_bench_v41_decode_small_runs(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "DS4_REQUIRE_CUDA"}
    out = tmp_path / "v41.jsonl"
    p = subprocess.run([sys.executable, "bench/bench_v41_decode.py", "--small", "--out", str(out)], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=1500)
    assert p.returncode == 0, p.stderr[-3000:]
    rows = [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]
    assert [json.loads(line) for line in out.read_text().splitlines()] == rows
    run, ctx = rows[0], rows[1:]
    assert run["kind"] == "run" and run["weight_bytes"] > 0 and run["roofline"]["roofline_tbps"] > 0
    assert run["bits"] == [13, 12] and sum(run["weight_bytes_per_token"].values()) > 0
    assert [r["context"] for r in ctx] == [8]
    assert "graph" not in ctx[0]
    for mode in ("eager",):
        x = ctx[0][mode]
        assert x["tokens_per_s"] > 0 and x["kernel_launches_per_token"] > 10 and 0 <= x["last_token"] < 64
        assert x["ms_per_token_rounds"] == [x["ms_per_token"]]            # one round (--rounds 1): its own median
    assert "per-op" in p.stdout or "no per-op table" in p.stdout


def _bench_module():
    import importlib.util
    spec = importlib.util.spec_from_file_location("bench_v41_decode_mod", ROOT / "bench" / "bench_v41_decode.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_kernel_names_as_cupti_demangles_them():
    b = _bench_module()
    assert b.kernel_op("kernels::vq_gemv::_make_vq_kernel::_3clocals_3e::vq_gemv_kernel[abi:v13][abi:cw5]") == (
        "vq_gemv", "vq_gemv_kernel")
    assert b.kernel_op("kernels::moe::route_topk_kernel[abi:v952]") == ("moe", "route_topk_kernel")
    assert b.kernel_op("_ZN7kernels3moe17route_topk_kernelB2v1E") == ("moe", "route_topk_kernel")
    assert b.kernel_op("Memcpy DtoH")[0] == "other"


def test_stream_timeline_splits_the_main_streams_gaps():
    """Main stream 7: k1 [0, 10), k2 [15, 25), k3 [40, 45), k4 [60, 65); stream 9: s1 [5, 35), over two steps.
    The gaps of the main stream: [10, 15) while s1 runs (a wait of 5), [25, 40) of which s1 covers 10 (a wait of 10,
    5 idle), [45, 60) idle."""
    b = _bench_module()

    def ev(name, ts, dur, st):
        return {"ph": "X", "cat": "kernel", "name": f"kernels::m::{name}[abi:v1]", "ts": ts, "dur": dur,
                "args": {"stream": st}}
    events = [ev("k1", 0, 10, 7), ev("k2", 15, 10, 7), ev("s1", 5, 30, 9), ev("k3", 40, 5, 7), ev("k4", 60, 5, 7)]
    tl = b.stream_timeline(events, 2)
    assert tl["busy_us"] == 22.5 and tl["overlap_us"] == 7.5
    assert tl["streams"] == [[7, 15.0, 2.0], [9, 15.0, 0.5]]
    assert tl["main_waits_us"] == 7.5 and tl["main_idle_us"] == 10.0
    assert tl["waits"] == [["k2", "k3", 5.0, 0.5], ["k1", "k2", 2.5, 0.5]]
    assert b.stream_timeline([], 1) is None


def test_launch_shapes_split_a_kernel_by_its_grid():
    """One kernel launched with two grids (two matrices) is two rows, the larger device time first; copies and
    memsets are not kernels; the times are per step and per launch."""
    b = _bench_module()

    def ev(name, dur, grid, cat="kernel"):
        return {"ph": "X", "cat": cat, "name": f"kernels::q4k_gemv::{name}[abi:v1]", "ts": 0, "dur": dur,
                "args": {"stream": 7, "grid": grid, "block": [128, 1, 1]}}
    events = [ev("q4k_imma_kernel", 15, [512, 1, 1]), ev("q4k_imma_kernel", 17, [512, 1, 1]),
              ev("q4k_imma_kernel", 190, [8080, 1, 1]), ev("rms_norm_row_kernel", 5, [8, 1, 1]),
              ev("Memcpy DtoH", 2, [1, 1, 1], cat="gpu_memcpy")]
    rows = b.launch_shapes(events, 2)
    assert rows == [["q4k_imma_kernel", "8080,1,1", "128,1,1", 95.0, 0.5, 190.0],
                    ["q4k_imma_kernel", "512,1,1", "128,1,1", 16.0, 1.0, 16.0],
                    ["rms_norm_row_kernel", "8,1,1", "128,1,1", 2.5, 0.5, 5.0]]
    assert b.launch_shapes(events, 1, top=1) == [["q4k_imma_kernel", "8080,1,1", "128,1,1", 190.0, 1.0, 190.0]]


def test_timeline_rows_are_the_events_in_start_order():
    b = _bench_module()

    def ev(name, ts, dur, st, grid):
        return {"ph": "X", "cat": "kernel", "name": f"kernels::m::{name}[abi:v1]", "ts": ts, "dur": dur,
                "args": {"stream": st, "grid": grid, "block": [128, 1, 1]}}
    rows = b.timeline_rows([ev("k2", 115.5, 4, 7, [2, 1, 1]), ev("k1", 100, 10, 9, [512, 1, 1])], 1024)
    assert rows == [{"context": 1024, "kernel": "k1", "op": "m", "grid": "512,1,1", "block": "128,1,1", "stream": 9,
                     "start_us": 0.0, "dur_us": 10.0},
                    {"context": 1024, "kernel": "k2", "op": "m", "grid": "2,1,1", "block": "128,1,1", "stream": 7,
                     "start_us": 15.5, "dur_us": 4.0}]
    assert b.timeline_rows([], 8) == []
