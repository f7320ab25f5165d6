"""ds4-tiny's DSpark draft on the CUDA backend (a GPU, or the simulator with NUMBA_ENABLE_CUDASIM=1: ~20 min)
against the CPU backend, both from the CPU's prompt features: ring rows, every observation point of the stage layers
(attention and MoE outputs, router choices, expert outputs), base logits, drafts and confidences.

    python bench/dev/draft_diag.py [prompt tokens, default 40]
"""
import os
import sys
import time
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
    from tests.kernels.cudasim_shim import install
    install()
import numpy as np
from ds4lib.engine import Engine
from ds4lib.corpus.slices import load_slice
from tests.kernels.tolerances import nmse
from ds4lib.formats.floats import bf16_bits_to_f32

B = "models/ds4-tiny-base.gguf"; C = "models/ds4-tiny"
cpu = Engine(B, engram_dir=C); cuda_e = Engine(B, engram_dir=C, backend="cuda")
cb, gb = cpu.backend, cuda_e.backend
cfg = cpu.cfg
print("stages", gb.draft.stages, "B", cfg.dspark_block_size, "V", cfg.vocab_size, "dim", cfg.dim, flush=True)
n = int(sys.argv[1]) if len(sys.argv) > 1 else 40
toks = [0] + [int(t) for t in load_slice("english/judge").tokens[0][:n]]
prompt, anchor = toks[:-1], toks[-1]
cs = cb.new_state(); out_c = cb.forward(cs, prompt)
gs = gb.new_state()
t0 = time.time()
# the CUDA state's backbone is not needed for the draft: rings come from the CPU's features
cb.append_context(cs, out_c.features, np.arange(len(prompt)))
gb.draft.append_context(gs, out_c.features, np.arange(len(prompt)))
W = cfg.window_size
order = np.argsort(gs.dring_host[gs.dring_host >= 0])
for i, l in enumerate(gb.draft.stages):
    rows = bf16_bits_to_f32(gs.dwin_all.copy_to_host()[i, :W][gs.dring_host >= 0][order])
    print("ring", l, "nmse", nmse(rows, cs.win_kv[l]), "maxabs", float(np.abs(rows - cs.win_kv[l]).max()), flush=True)
seen_g, seen_c = {}, {}
pc = cb.model.dspark_propose(cs, anchor, len(prompt) - 1, None,
                             observer=lambda l, n, v: seen_c.setdefault((l, n), np.array(v)))
pg = gb.draft.propose(gs, anchor, len(prompt) - 1, observer=lambda l, n, v: seen_g.setdefault((l, n), np.array(v)))
for k in sorted(seen_c, key=str):
    if k in seen_g:
        a, b = seen_g[k].astype(np.float64), seen_c[k].astype(np.float64)
        if a.shape != b.shape:
            print(k, "shapes", a.shape, b.shape); continue
        if k[1] in ("router_ids", "topk"):
            print(k, "same", bool((a == b).all()), a.reshape(len(a), -1)[:, :8].tolist(), b.reshape(len(b), -1)[:, :8].tolist())
        else:
            print(k, "nmse %.3g" % nmse(a, b), "frac differ %.4f" % float((a != b).mean()), "maxabs %.4g" % float(np.abs(a - b).max()))
    else:
        print(k, "not observed on cuda")
bg, bc = gb.to_host(pg.base_logits), pc.base_logits
print("base nmse", nmse(bg, bc), "per row", [float(nmse(bg[i], bc[i])) for i in range(len(bc))])
print("tokens cpu", list(pc.tokens), "cuda", list(pg.tokens))
print("conf cpu", pc.confidence, "cuda", pg.confidence, "s", time.time() - t0)
