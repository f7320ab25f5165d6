"""Dev probe on the H200 (not a benchmark of record): the index-score kernel layouts at V4.1's indexer shape
(32 heads x 128 dims, one decode query) over 256, 4,096 and 16,384 compressed rows (1k, 16k and 64k context at
ratio 4), keys cycled over copies past L2, CUDA-graph replay; bits compared with index_score_rows_kernel's.

    python bench/dev/index_probe.py          # JSON lines: variant, rows, us per call
"""
import json
import math
import sys

sys.path.insert(0, ".")
import numpy as np  # noqa: E402
from numba import cuda  # noqa: E402

from bench.timing import graph_time  # noqa: E402
from ds4lib.formats.actquant import act_quant_fp4_pow2  # noqa: E402
from ds4lib.formats.floats import f32_to_bf16_bits, round_bf16  # noqa: E402
from kernels import indexer  # noqa: E402
from kernels.dev import index_score_v1, index_score_v2, index_score_v4  # noqa: E402

NI, DI = 32, 128
rng = np.random.default_rng(0)
s = cuda.stream()
q = cuda.to_device(act_quant_fp4_pow2(rng.standard_normal((1, NI, DI)).astype(np.float32)), stream=s)
wts = cuda.to_device(round_bf16(rng.standard_normal((1, NI))), stream=s)
pos = cuda.to_device(np.array([1 << 20], np.int64), stream=s)
cand = cuda.to_device(np.ones((1, 1), np.uint8), stream=s)
cand_all = cand                                   # one candidate block covering every row: nothing masked
for rows in (256, 4096, 16384):
    copies = max(1, math.ceil(120e6 / (rows * DI * 2)))
    keys = [cuda.to_device(f32_to_bf16_bits(act_quant_fp4_pow2(rng.standard_normal((rows, DI)).astype(np.float32))),
                           stream=s) for _ in range(min(copies, 32))]
    copies = len(keys)
    want = indexer.index_scores(q, wts, 0.5, keys[0], pos, 4, stream=s, tensor_cores=False).copy_to_host(stream=s)
    for name, mod in (("v1 thread: 2 rows, all heads", index_score_v1), ("v2 warp: a row, lane per head", index_score_v2),
                      ("v3 thread: a row, all heads, q in shared (index_score_rows_kernel)", False),
                      ("v5 warp: 16-row tiles on the BF16 tensor cores (index_score_kernel)", True),
                      ("v4 warp: a row per coalesced load, shuffled", index_score_v4)):
        out = cuda.device_array((1, rows), np.float32, stream=s)
        it = [0]

        def call():
            k = keys[it[0] % copies].view(np.uint64)
            if isinstance(mod, bool):
                indexer.index_scores(q, wts, 0.5, keys[it[0] % copies], pos, 4, cand=cand_all, cand_block=rows,
                                     out=out, stream=s, tensor_cores=mod)
            else:
                grid, threads = mod.grid(rows, 1)
                mod.index_score_kernel[grid, threads, s](q, wts, np.float32(0.5), k, pos, 4, cand, 1, False, out)
            it[0] += 1
        it[0] = 0
        call()
        s.synchronize()
        same = bool((out.copy_to_host(stream=s).view(np.uint32) == want.view(np.uint32)).all())
        sec = graph_time(call, s, max(4 * copies, 40))
        print(json.dumps({"variant": name, "rows": rows, "us": round(sec * 1e6, 2), "same_bits": same}), flush=True)
