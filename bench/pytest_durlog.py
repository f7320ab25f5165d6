"""A pytest plugin that appends each test's wall time (setup + call + teardown) to a file as soon as the test ends,
so a long or interrupted run still leaves its per-test times (pytest's --durations prints only at the end).

    DURLOG=/tmp/durlog.tsv .venv/bin/python -m pytest -q -p bench.pytest_durlog [tests ...]
    sort -rn /tmp/durlog.tsv | head -30

One line per test: seconds, a tab, the node id.
"""
import os
import time

_started = {}


def pytest_runtest_logstart(nodeid, location):
    _started[nodeid] = time.perf_counter()


def pytest_runtest_logfinish(nodeid, location):
    seconds = time.perf_counter() - _started.pop(nodeid, time.perf_counter())
    with open(os.environ.get("DURLOG", "durlog.tsv"), "a") as f:
        f.write(f"{seconds:.2f}\t{nodeid}\n")
