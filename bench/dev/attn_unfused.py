"""Run bench/bench_v41_decode.py with the attention's two fused launches split out again, for an A/B on one lease:
the queries' RoPE as its own kernels.rope launch before the attention, and the window ring's write as its own
window_write launch after it (the twenty-fourth session moved both into the score and combine kernels; the bits
are the same, so the last greedy token must be too).

    python bench/dev/attn_unfused.py --contexts 1024,65536 --rounds 3 --trace-steps 0 --graph-only --out F.jsonl

It wraps kernels.attention.sparse_attention, so every caller (the engine's layers, the DSpark drafts) takes the
unfused launches; the score and combine kernels then run with their fused paths switched off. The softmax, which
the same session moved into the value kernel, stays there (its old kernel is gone: time it against the tree before
the fusions, BENCHMARKS.md "Next device call").
"""
import runpy
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import kernels.attention as attention  # noqa: E402
import kernels.rope as rope  # noqa: E402

_fused = attention.sparse_attention


def sparse_attention_unfused(q, *args, rope_q=None, window=None, stream=0, **kw):
    """sparse_attention with `rope_q` as a rope launch (in place on q, as the engine's query path did) and `window`
    as a window_write launch."""
    if rope_q is not None:
        rope.rope(q, *rope_q, stream=stream)
    out = _fused(q, *args, stream=stream, **kw)
    if window is not None:
        attention.window_write(*window, stream=stream)
    return out


attention.sparse_attention = sparse_attention_unfused
sys.argv = [str(ROOT / "bench" / "bench_v41_decode.py")] + sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
