"""Dev runner (not a benchmark of record): run a script with module knobs changed first, so that one device call can
A/B variants that are module attributes without editing files:

    python bench/dev/knobs.py --exec "import kernels.attention as a; a.SCORE_BLOCKS = 512" \
        -- bench/bench_v41_decode.py --contexts 1024 --rounds 3 --trace-steps 0 --graph-only --out F.jsonl

Each --exec statement runs in order before the script (runpy, as __main__, with the arguments after --). Only a
knob read at call time changes anything: a constant a kernel factory took when its module was imported needs that
kernel rebuilt in the statement too. On a warm machine a V4.1 decode variant at 1k takes about 6 s (H100,
--experts 160; BENCHMARKS.md, twenty-ninth session)."""
import runpy
import sys

sys.path.insert(0, ".")

if __name__ == "__main__":
    argv = sys.argv[1:]
    if "--" not in argv:
        sys.exit("knobs.py: --exec STATEMENT ... -- SCRIPT [ARGS]")
    cut = argv.index("--")
    head, rest = argv[:cut], argv[cut + 1:]
    if len(head) % 2 or any(flag != "--exec" for flag in head[::2]) or not rest:
        sys.exit("knobs.py: --exec STATEMENT ... -- SCRIPT [ARGS]")
    for stmt in head[1::2]:
        exec(stmt, {})  # noqa: S102  (a dev runner: the statements are the caller's own)
    sys.argv = rest
    runpy.run_path(rest[0], run_name="__main__")
