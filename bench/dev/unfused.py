"""Run bench/bench_v41_decode.py with fused launches split out again, for an A/B on one lease (the bits are the same
either way, so the last greedy token must be too):

    python bench/dev/unfused.py --split attn|vq|wo_a|q_norm|combine|wo_b|route|norm|sh_stage|xq_stage|q_stage|\
        w2_stage|rope_q|attn,vq,... \
        --contexts 1024,65536 \
        --rounds 3 --trace-steps 0 --graph-only --out F.jsonl

- `attn` (the twenty-fourth session's fusions): the queries' RoPE as its own kernels.rope launch before the
  attention, and the window ring's write as its own window_write launch after it. It wraps
  kernels.attention.sparse_attention, so every caller (the engine's layers, the DSpark drafts) takes the unfused
  launches; the score and combine kernels then run with their fused paths switched off. The softmax, which the same
  session moved into the value kernel, stays there (its old kernel is gone: time it against the tree before the
  fusions, BENCHMARKS.md "Next device call").
- `vq` (the twenty-fifth session's): the MoE's gate / up input staged by its own vq_stage launch again, not by the
  ffn norm (kernels.rms_norm.hc_rms_norm's `vq`, kernels.vq_gemv.vq_gemv's `staged`); the shared expert's staging
  (`sh_stage`), which rides on the same norm kernel, goes with it (as when this split was timed).
- `wo_a` (the same session's): the attention output staged for wo_a's integer path by its own q4k_im_stage launch
  again, not by the combine kernel (kernels.attention.sparse_attention's `im_stage`, kernels.q4k_gemv's `staged`:
  the backend's `_im_staging` gives no buffers).
- `q_norm` (the twenty-sixth session's): the q latent normed by its own rms_norm launch again, not in the staging of
  wq_b (ds4lib.engine.backend_cuda.NORM_IN_STAGING off). Since the thirty-seventh session wq_b takes the integer path
  by default (kernels.q4k_gemv.IM_FP8_MIN_* = 0) and the norm is launched anyway: this split changes nothing unless
  those are raised (kernels.q4k_gemv.norm_path).
- `combine` (the same session's): the MoE's combine as its own moe_combine launch again, not formed in the ffn's
  hc_post (ds4lib.engine.backend_cuda.COMBINE_IN_POST off).
- `wo_b` (the same session's): wo_b's integer-path operands staged by their own q4k_im_stage launch again, not by
  wo_a's kernel (ds4lib.engine.backend_cuda.STAGE_WO_B off).
- `route` (the twenty-seventh session's): the router's top-k as its own route_topk launch after the gate's GEMV
  again, not in the GEMV's last block (kernels.moe.ROUTE_IN_GEMV off).
- `norm` (the same session's): the decode step's norms in one block a row again, not ELEMS blocks a row
  (kernels.rms_norm.SPLIT_ROWS_MAX = 0).
- `sh_stage` (the thirty-first session's): the shared expert's gate / up input staged for the integer path by its
  own q4k_im_stage launch on the side stream again, not by the ffn norm (ds4lib.engine.backend_cuda
  .STAGE_SHARED_IN_NORM off).
- `xq_stage` (the thirty-eighth session's): wq_a's and wkv's integer-path input staged by their own q4k_im_stage
  launches again (one on the main stream, one on the side stream), not by the attention norm
  (ds4lib.engine.backend_cuda.STAGE_XQ_IN_NORM off).
- `q_stage` (the same session's): the q latent staged for wq_b (and the indexer's wq_b) by their own launches again,
  not by the q latent's norm (STAGE_Q_IN_NORM off).
- `w2_stage` (the same session's): the shared expert's w2 input staged by its own launch again, not by its SwiGLU
  (STAGE_W2_IN_SWIGLU off).
- `rope_q` (the same session's): the window key's norm + RoPE + quantiser in one block a row again, not ELEMS
  blocks (kernels.rms_norm.ROPE_Q_SPLIT off; `norm` covers it too, with the other norms).
"""
import argparse
import runpy
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import ds4lib.engine.backend_cuda as backend_cuda  # noqa: E402
import kernels.attention as attention  # noqa: E402
import kernels.moe as moe  # noqa: E402
import kernels.rms_norm as rms_norm  # noqa: E402
import kernels.rope as rope  # noqa: E402
import kernels.vq_gemv as vq_gemv  # noqa: E402

def _split_attention():
    fused = attention.sparse_attention

    def sparse_attention_unfused(q, *args, rope_q=None, window=None, stream=0, **kw):
        """sparse_attention with `rope_q` as a rope launch (in place on q, as the engine's query path did) and
        `window` as a window_write launch."""
        if rope_q is not None:
            rope.rope(q, *rope_q, stream=stream)
        out = fused(q, *args, stream=stream, **kw)
        if window is not None:
            attention.window_write(*window, stream=stream)
        return out
    attention.sparse_attention = sparse_attention_unfused


def _drop_argument(module, fname, keyword):
    """module.fname called without its `keyword` argument (the fused path's), whatever the caller passes."""
    fused = getattr(module, fname)

    def unfused(*args, **kw):
        kw.pop(keyword, None)
        return fused(*args, **kw)
    setattr(module, fname, unfused)


def _set(module, name, value=False):
    """A split that sets module.name (a fused path's switch) to `value`."""
    return lambda: setattr(module, name, value)


_split_sh_stage = _set(backend_cuda, "STAGE_SHARED_IN_NORM")


def _split_vq():
    _drop_argument(rms_norm, "hc_rms_norm", "vq")
    _split_sh_stage()                 # as timed then (hc_rms_norm took `im` only with `vq` until the 38th session)
    _drop_argument(vq_gemv, "vq_gemv", "staged")


def _split_wo_a():
    backend_cuda.CudaBackend._im_staging = lambda self, l, T: None    # no buffers: the combine stages nothing and
                                                                      # wo_a launches its staging


SPLITS = {"attn": _split_attention, "vq": _split_vq, "wo_a": _split_wo_a,
          "q_norm": _set(backend_cuda, "NORM_IN_STAGING"), "combine": _set(backend_cuda, "COMBINE_IN_POST"),
          "wo_b": _set(backend_cuda, "STAGE_WO_B"), "route": _set(moe, "ROUTE_IN_GEMV"),
          "norm": _set(rms_norm, "SPLIT_ROWS_MAX", 0),              # (rms_norm_rope_q's split form too)
          "sh_stage": _split_sh_stage, "xq_stage": _set(backend_cuda, "STAGE_XQ_IN_NORM"),
          "q_stage": _set(backend_cuda, "STAGE_Q_IN_NORM"), "w2_stage": _set(backend_cuda, "STAGE_W2_IN_SWIGLU"),
          "rope_q": _set(rms_norm, "ROPE_Q_SPLIT")}


def main(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--split", default=",".join(SPLITS), help=f"comma-separated, of {', '.join(SPLITS)}")
    args, rest = ap.parse_known_args(argv)
    which = [s for s in args.split.split(",") if s]
    if not which or any(s not in SPLITS for s in which):
        ap.error(f"--split {args.split!r}: expected a comma-separated list of {', '.join(SPLITS)}")
    for s in which:
        SPLITS[s]()
    sys.argv = [str(ROOT / "bench" / "bench_v41_decode.py")] + rest
    runpy.run_path(sys.argv[0], run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
