"""Device weights of the CUDA backend: what `CudaBackend` reads, built once at load.

Owns `CudaWeights` (globals `g`: embed, head, norm; per layer `L[l]`: a dict keyed by the tensor's name without its
layer prefix, plus the VQ payload keys below; `nbytes`), `Lin` (a linear's device weight and how kernels read it),
and `upload_base`, which builds them from a ds4 base file:
- q4_K / Q8_0 linears as their GGUF block bytes (kernels.q4k_gemv; the embedding included); F16 linears as float32;
  stored projections of GEMV_WEIGHTS (and any other linear whose values are BF16-exact) as BF16 bit patterns
  (kernels.gemv); vectors and the mHC matrices as float32.
- VQ experts: `vq_index` uint8 [E, 3, S] and `vq_plane` uint8 [E, 3, P] or None (12-bit layers) moved at upload
  into the device layout of kernels.vq_gemv (vq_device_layout: the tensor-core fragments' order), `vq_gains`
  (w1, w2, w3) f16 bits uint16 [E, rows], the layer's E4M3 codebook as its own bytes `vq_cb` uint64 [C] (8 codes a
  word; NaN codes refused), `vq_experts` E, and `vq_scale` float32 [E, D]: the ② sidecar / ③
  post-training down-projection gains (None without them). Router deltas are added to `ffn.gate.bias` in float32,
  exactly as ds4lib.engine.weights.StackWeights does.
- The shared expert's w1 and w3 joined into one linear `ffn.shared_experts.w13` of 2F rows (`join_shared_gate_up`):
  one GEMV launch for both.
Synthetic weights at the true V4.1 shapes for the real-size benchmark are built into the same structure on the
device directly (ds4lib.engine.cuda_synth).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

import kernels  # noqa: F401  (numpy 2.5 alias for numba-cuda before anything compiles)
from numba import cuda

from ds4lib.formats.floats import f32_to_bf16_bits, round_bf16
from ds4lib.formats.names import EMBED, HEAD, NORM, layer_prefix
from ds4lib.formats.vq import EXPERT_MATRICES
from kernels import vq_gemv

__all__ = ["CudaWeights", "Lin", "upload_base", "join_shared_gate_up", "GEMV_WEIGHTS", "SHARED_W13"]

# stored 2-D tensors that feed kernels.gemv (kept as BF16 bit patterns when their values are BF16-exact)
GEMV_WEIGHTS = ("attn.compressor.wkv.weight", "attn.compressor.wgate.weight", "attn.indexer.wq_b.weight",
                "attn.indexer.weights_proj.weight", "attn.indexer.wk.weight", "ffn.gate.weight")
SHARED_W1, SHARED_W3 = "ffn.shared_experts.w1.weight", "ffn.shared_experts.w3.weight"
SHARED_W13 = "ffn.shared_experts.w13"   # the shared expert's gate and up rows in one linear (join_shared_gate_up)


@dataclass
class Lin:
    """A linear's device weight: kind 'q4_K' | 'q8_0' (block bytes), 'bf16' (uint16 bits) or 'f32'; `rows`
    outputs, `k` inputs."""
    kind: str
    w: object
    rows: int
    k: int


@dataclass
class CudaWeights:
    g: dict
    L: list
    nbytes: int = 0
    arrays: list = field(default_factory=list, repr=False)

    def up(self, a):
        """Copy a host array to the device and count its bytes."""
        d = cuda.to_device(np.array(a, copy=True, order="C"))
        self.nbytes += d.size * d.dtype.itemsize
        return d


def _lin(W, base, name):
    t = base.layout[name]
    rows, k = t.shape[0], t.shape[-1]
    if t.kind in ("q4_K", "q8_0"):
        return Lin(t.kind, W.up(base.raw(name).view(np.uint8)), rows, k)
    v = base.tensor(name).astype(np.float32)
    if t.kind != "f16" and np.array_equal(round_bf16(v), v):
        return Lin("bf16", W.up(f32_to_bf16_bits(v)), rows, k)
    return Lin("f32", W.up(v), rows, k)


def upload_base(cfg, base, gains, bias, stages: bool = False) -> CudaWeights:
    """The device weights of `base` (a ds4lib.formats.gguf.BaseFile) with optional sidecar gains {layer: [E, D]}
    and router deltas {layer: [E]} (module docstring); with `stages`, also the DSpark draft stages (layers n_layers
    .. n_all_layers - 1: their VQ experts, main_proj and the draft head's Markov and confidence weights, stored
    like the backbone's)."""
    W = CudaWeights({}, [])
    W.g = {"embed": _lin(W, base, EMBED), "head": _lin(W, base, HEAD), "norm": W.up(base.tensor(NORM))}
    if W.g["embed"].kind not in ("q4_K", "q8_0"):
        raise ValueError(f"the embedding is {W.g['embed'].kind}, expected q4_K or Q8_0 blocks")
    for l in range(cfg.n_all_layers if stages else cfg.n_layers):
        p = layer_prefix(cfg, l)
        w = {}
        for name, t in base.layout.items():
            if not name.startswith(p) or name.endswith(".scale") or t.kind.startswith("vq_"):
                continue
            rel = name[len(p):]
            if t.kind in ("q4_K", "q8_0", "f16") or rel in GEMV_WEIGHTS:
                w[rel] = _lin(W, base, name)
            else:
                v = base.tensor(name).astype(np.float32)
                if rel == "ffn.gate.bias" and l in bias:
                    v = (v + np.asarray(bias[l], dtype=np.float32)).astype(np.float32)
                w[rel] = W.up(v)
        if w["ffn.gate.weight"].kind != "bf16":
            raise ValueError(f"layer {l}: the router weight is not BF16-valued")
        vq = base.vq_layer(l)
        try:
            w["vq_cb"] = vq_gemv.vq_codebook(W.up(vq.codebook_codes.view(np.uint8)))
        except ValueError as exc:
            raise ValueError(f"layer {l}: {exc}") from None
        index = W.up(vq.index.view(np.uint8))
        plane = W.up(vq.plane.view(np.uint8)) if vq.plane is not None else None
        W.nbytes -= index.nbytes + (plane.nbytes if plane is not None else 0)
        w["vq_index"], w["vq_plane"] = vq_gemv.vq_device_layout(index, plane, vq.shapes["w1"], vq.shapes["w2"])
        del index, plane                                         # the file's layout is not kept on the device
        W.nbytes += w["vq_index"].nbytes + (w["vq_plane"].nbytes if w["vq_plane"] is not None else 0)
        w["vq_gains"] = tuple(W.up(vq.gains[m].view(np.uint16)) for m in EXPERT_MATRICES)
        w["vq_scale"] = W.up(np.asarray(gains[l], dtype=np.float32)) if l in gains else None
        w["vq_experts"] = vq.n_experts
        join_shared_gate_up(w)
        W.L.append(w)
    return W


def join_shared_gate_up(w, stream=0):
    """Replace a layer's shared-expert w1 [F, D] and w3 [F, D] by one linear `SHARED_W13` of 2F rows (w1's rows,
    then w3's), made on the device, when both are stored the same way: the gate and the up projection read the
    same activations, so one GEMV launch serves both (rows are independent in every stored kind, and each output
    row is the same function of its own row and x). The two originals are dropped: the bytes stay the same."""
    a, b = w.get(SHARED_W1), w.get(SHARED_W3)
    if not isinstance(a, Lin) or not isinstance(b, Lin) or (a.kind, a.rows, a.k) != (b.kind, b.rows, b.k) \
            or a.w.shape[1:] != b.w.shape[1:] or a.w.dtype != b.w.dtype:
        return w
    joined = cuda.device_array((a.w.shape[0] + b.w.shape[0],) + tuple(a.w.shape[1:]), a.w.dtype, stream=stream)
    joined[:a.w.shape[0]].copy_to_device(a.w, stream=stream)
    joined[a.w.shape[0]:].copy_to_device(b.w, stream=stream)
    w[SHARED_W13] = Lin(a.kind, joined, a.rows + b.rows, a.k)
    del w[SHARED_W1], w[SHARED_W3]
    return w
