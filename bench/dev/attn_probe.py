"""Dev probe on the GPU (not a benchmark of record): the sparse attention of one decode token at V4.1's shapes (64
heads of 512, a window of 128 rows, the indexer's top-k compressed rows), keys cold (copies cycled past L2), per
call from a CUDA graph of many calls, in these forms:

    python bench/dev/attn_probe.py                       # rows 128 (a window-only layer) and 640 (128 + 512)
    python bench/dev/attn_probe.py --rows 640 --forms score --rpq 1,2,4

- `full`: kernels.attention.sparse_attention as the engine's decode calls it (the query's RoPE in the score kernel,
  the output's inverse RoPE in the combine; no window write, no staging): three launches;
- `score`: attn_score_kernel alone (with the query's RoPE), `score_norope` without it;
- `value`: attn_value_kernel alone (the softmax's max and denominator and the weighted values) on scores made;
- `combine`: attn_combine_kernel alone (with the inverse RoPE);
- `empty`: a kernel of one block that does nothing (a graph node's own cost, to subtract).
The whole-step trace (BENCHMARKS.md, thirty-ninth session: H100, PDL off) gave the score kernel 12.1-12.7 us a call
alone and 16-17 beside the FFN's mixes, for 128 rows as for 640, and the value kernel 8.1 / 12.2 us: this says
whether the time follows the rows, the RoPE, the rows a quad (`--rpq`) or none of them. One JSON line a form.
"""
import argparse
import json
import math
import os
import sys

sys.path.insert(0, ".")
from bench.timing import empty_node, probe_time, use_simulator  # noqa: E402
if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":    # a tiny --eager check on the CPU: the warp-intrinsic shim
    use_simulator()
import numpy as np  # noqa: E402
from numba import cuda  # noqa: E402

from kernels import attention as at  # noqa: E402


def _bf16_rows(rng, n, dh):
    """BF16 bits of n rows of dh values ~ N(0, 1) (upper halves of float32)."""
    return (rng.standard_normal((n, dh)).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)


def main(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="128,640", help="comma-separated rows a query (window 128 + compressed)")
    ap.add_argument("--heads", type=int, default=64)
    ap.add_argument("--head-dim", type=int, default=512)
    ap.add_argument("--window", type=int, default=128)
    ap.add_argument("--rope-dim", type=int, default=64)
    ap.add_argument("--cache-rows", type=int, default=4096, help="compressed cache rows the top-k picks from")
    ap.add_argument("--forms", default="full,score,score_norope,value,combine,empty")
    ap.add_argument("--rpq", default="0", help="rows a quad of the score forms (0: the launcher's choice)")
    ap.add_argument("--cold-bytes", type=float, default=240e6, help="bytes of key copies cycled (past L2)")
    ap.add_argument("--calls", type=int, default=0, help="calls a graph (0: enough to cycle the copies 4 times)")
    ap.add_argument("--eager", action="store_true", help="eager calls only (for Nsight Compute), no timing")
    a = ap.parse_args(argv)
    s = cuda.stream()
    rng = np.random.default_rng(0)
    H, Dh, W, P = a.heads, a.head_dim, a.window, 4096
    pos = 1000
    q = cuda.to_device((rng.standard_normal((1, H, Dh)) * 0.05).astype(np.float32), stream=s)
    sink = cuda.to_device(rng.standard_normal(H).astype(np.float32), stream=s)
    cos = cuda.to_device(rng.uniform(-1, 1, (P, a.rope_dim // 2)).astype(np.float32), stream=s)
    sin = cuda.to_device(rng.uniform(-1, 1, (P, a.rope_dim // 2)).astype(np.float32), stream=s)
    positions = cuda.to_device(np.array([pos], np.int64), stream=s)
    out = cuda.device_array((1, H, Dh), np.float32, stream=s)
    win_idx = cuda.to_device(np.arange(W, dtype=np.int32)[None], stream=s)     # the ring's rows, all valid
    for n_rows in (int(v) for v in a.rows.split(",")):
        kc = n_rows - W
        copy_bytes = (W + 1 + (a.cache_rows if kc else 0)) * Dh * 2
        copies = max(1, math.ceil(a.cold_bytes / copy_bytes))
        win_keys = [cuda.to_device(_bf16_rows(rng, W + 1, Dh), stream=s) for _ in range(copies)]
        cmp_keys = [cuda.to_device(_bf16_rows(rng, a.cache_rows, Dh), stream=s) for _ in range(copies)] if kc \
            else [None] * copies
        cmp_idx = cuda.to_device(np.sort(rng.choice(a.cache_rows, kc, replace=False)).astype(np.int32)[None],
                                 stream=s) if kc else None
        scratch = {}
        it = [0]

        def full():
            i = it[0] % copies
            at.sparse_attention(q, win_keys[i], win_idx, cmp_keys[i], cmp_idx, sink, Dh ** -0.5, out=out,
                                scratch=scratch, stream=s, rope_q=(positions, cos, sin),
                                inverse_rope=(positions, cos, sin))
            it[0] += 1
        full()                                    # the scratch (z, den, part) and the launcher's choices
        s.synchronize()
        sc = {key[0]: arr for key, arr in scratch.items()}          # (keyed by name, shape and dtype)
        z, den, part = sc["z"], sc["den"], sc["part"]
        ck_idx = cmp_idx if kc else sc["no_idx"]
        hb = H // at.HEADS_PER_BLOCK

        def score(rpq, rope):
            def run():
                i = it[0] % copies
                ck = (cmp_keys[i] if kc else sc["no_keys"]).view(np.uint64)
                r = rpq or at._score_rows_per_quad(1, hb, n_rows)
                grid = (math.ceil(n_rows / (at.THREADS // 4 * r)), hb, 1)
                at.attn_score_kernel[grid, at.THREADS, s](q, win_keys[i].view(np.uint64), win_idx, ck, ck_idx,
                                                          np.float32(Dh ** -0.5), r, positions, cos, sin, rope, z)
                it[0] += 1
            return run

        def value():
            i = it[0] % copies
            ck = (cmp_keys[i] if kc else sc["no_keys"]).view(np.uint64)
            at.attn_value_kernel[(part.shape[1], hb, 1), at.THREADS, s](z, sink, win_keys[i].view(np.uint64),
                                                                        win_idx, ck, ck_idx, den, part)
            it[0] += 1


        def combine():
            at.attn_combine_kernel[at._blocks(H * Dh), at.THREADS, s](
                part, den, positions, cos, sin, True, sc["no_kv"], sc["no_positions"], sc["no_ring"],
                sc["no_positions"], False, sc["no_digits"], sc["no_pairs"], False, out)

        def empty():
            empty_node(at.THREADS, s)
        forms = []
        for name in a.forms.split(","):
            if name in ("score", "score_norope"):
                forms += [(name, int(r), score(int(r), name == "score")) for r in a.rpq.split(",")]
            else:
                forms.append((name, None, {"full": full, "value": value, "combine": combine, "empty": empty}[name]))
        for name, rpq, call in forms:
            it[0] = 0
            reps, us = probe_time(call, s, a.eager, a.calls, copies)
            print(json.dumps({"form": name, "rows": n_rows, "heads": H, "head_dim": Dh, "rpq": rpq,
                              "splits": part.shape[1], "copies": copies, "calls": reps,
                              "us_per_call": None if us is None else round(us, 2),
                              "z_sum": float(np.float64(z.copy_to_host()).sum()),
                              "out_sum": float(np.float64(out.copy_to_host()).sum())}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
