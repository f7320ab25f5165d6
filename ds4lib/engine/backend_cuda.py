"""The CUDA backend: the reference forward (ds4lib.ref.model) run by the Numba CUDA kernels of `kernels/` over the
quantised stack as stored. The only ds4lib module besides cuda_weights.py that imports `kernels`.

What lives where:
- weights (device, uploaded once): ds4lib.engine.cuda_weights (`upload_base` from the base file, or synthetic ones
  at the true V4.1 shapes from ds4lib.engine.cuda_synth for the real-size benchmark).
- Engram tables stay on the host (the original checkpoint): the n-gram hashes are computed on the host
  (ds4lib.ref.engram.engram_hashes, which the device hash kernel is tested against) from the session's history, the
  rows gathered from the memory map and decoded on the device (kernels.engram); a decode step reads them from a
  host-mapped staging buffer.
- session state: ds4lib.engine.cuda_state (per layer the window key buffer: W ring rows, then room for a chunk's
  rows, all layers in one array, and the position of each ring slot; the ratio-2 compressors' incomplete group (FP32
  kv and score); the compressed KV and index-key caches as BF16 rows (row s = compressed group s; capacity doubles,
  the row count is kept on the host); the Engram history (host)), with `mark` / `rollback` for speculative
  verification: after a marked call of 1 + k rows the state is rolled back exactly to its first n rows. Finished
  sessions' states come back (`release_state`, `detach_state`) to a pool that `new_state` and `copy_state` draw from,
  reset or overwritten in place, so the decode graphs captured over their buffers replay for the next requests.
- batched decode (`decode_batch`): one token of each of B sessions in one call, the projections, experts and head
  over the B rows, each session's attention state read and written per session; captured per set of sessions.
- the DSpark draft stages (their weights uploaded with the backbone's when the model has them): the context features
  of every call (`ForwardOut.features`, kernels.dspark), the stages' context rings and proposals in
  ds4lib.engine.cuda_dspark.
- sampling on the device (kernels.sampling); the host reads back the token only. Logits stay on the device unless
  `to_host` is asked (scoring); a decode step's logits are overwritten by the next decode step. A constrained step's
  token mask (int32 bitmask, ceil(V / 32) words) is uploaded each step and read by the sampling kernels.

A call's host plan (`_plan`) fixes every shape: how many compressed rows each compressor completes, the cache rows
each indexer and attention reads. Kernels never receive a position as a scalar: they read the call's positions from
the device (kernels.step), so a one-token decode step is the same sequence of launches at every position of a
bucket. Decode steps are captured per bucket into a CUDA graph (ds4lib.engine.cuda_graph) and replayed; a bucket
fixes the cache views (each owner's rows rounded up to a multiple of max(512 rows, 1/8 of a power of two),
`_bucket`), the buffers and the RoPE table: rows past a query's reach are masked by the kernels' own position rules,
so a wider view gives the same bits. The first step of a bucket is captured and the graph launched; where a launcher
created an array while capturing (a process's first step, a larger scratch shape) the graph is dropped, that step
runs eagerly and is captured again right after, in the same call. The device sampler over a decode step's logits
row is replayed from a graph of its own per sampling parameter set, its seed and step read from host-mapped memory.
`graphs=False` (or DS4_CUDA_GRAPHS=0) keeps every step and every sample eager. The graphs' kernel-to-kernel edges are
programmatic (kernels.pdl: a kernel's blocks are resident, waiting, when its predecessor completes; the same bits);
DS4_CUDA_PDL=0 keeps default edges. DS4_CUDA_PRIORITY=1 puts the main stream at the device's highest priority and
the side stream at its lowest, captured into the graphs' kernel nodes (ds4lib.engine.cuda_graph; off by default).

Three streams: what a layer needs only later runs beside the critical path — on the side stream the attention's
window key (its projection, norm and RoPE, written to the window ring with the window rows of the call) and, for
one session's rows, the compressor, beside the query path (wq_a, the q_norm and wq_b: `_query`); the
attention's mHC mixes (read h, first needed by its hc_post) after them, beside the attention itself; and the
shared expert, from the FFN's norm on, beside the routing and the routed experts —, forked from the main stream and
joined back by events (`_fork`, `_join`), with its own scratch (`scr_side`); and on the mix stream the FFN's mixes,
beside the whole MoE (`_fork_mix`, `_join_mix`, scratch `scr_mix`). A captured step holds them as parallel
branches of its graph. Every kernel's inputs and outputs are those of the one-stream order, so the bits are the
same. `CudaBackend.shared_expert_at` may fork the shared expert after the routing or keep it on the main stream,
and `ffn_mixes_apart=False` puts the FFN's mixes on the side stream before the shared expert (the same bits again;
the defaults were the fastest on an H100, BENCHMARKS.md, thirtieth session).

Operands staged by their producers: a q4_K GEMV on the integer tensor-core path reads its input as digits and block
pairs (kernels.im_operand), which a staging kernel writes unless the kernel that makes the input writes them as well
(the same bits): the attention norm for wq_a and wkv (STAGE_XQ_IN_NORM), the q latent's norm for wq_b and the
indexer's wq_b (STAGE_Q_IN_NORM), the attention's combine for wo_a, wo_a for wo_b (STAGE_WO_B), the ffn norm for the
shared expert's gate / up (STAGE_SHARED_IN_NORM; with the routed experts' VQ operand), the shared expert's SwiGLU for
its w2 (STAGE_W2_IN_SWIGLU). Each flag off launches that staging again (tests compare the bits; bench/dev/unfused.py
times them).

Semantics are ds4lib.ref.model's, with the per-query rules of docs/architecture.md §1.1, erratum E2 (window rows
from the ring before the chunk and from the chunk itself, compressed rows s < (t+1)//ratio per query, the
compressor's partial group carried across calls, window written after reading). Every kernel forms a token's result
in an order that does not depend on the other tokens of the call (the attention value split is fixed per layer, the
top-k width is always index_topk with -1 padding), so one-token decode, chunked prefill, single-shot prefill and a
replayed graph give the same bits.

Shapes: T tokens of a call, S = hc_mult streams, D hidden, H heads, Dh head dim, W window, K active experts,
E experts, F expert width, V vocab, Nc compressed rows.
"""
from __future__ import annotations

import time
import warnings

import numpy as np

import kernels  # noqa: F401  (numpy 2.5 alias for numba-cuda before anything compiles)
from numba import cuda
from numba.cuda.core import config as _cuda_config

from ds4lib.config import Env
from ds4lib.engine import cuda_graph, cuda_state
from ds4lib.engine.cuda_dspark import CudaDraft
from ds4lib.engine.cuda_graph import mapped as _mapped
from ds4lib.engine.cuda_state import CudaState
from ds4lib.engine.cuda_weights import SHARED_W13, CudaWeights, upload_base
from ds4lib.engram_geometry import engram_geometry
from ds4lib.formats.names import layer_prefix
from ds4lib.ref.engram import engram_hashes
from ds4lib.ref.model import ForwardOut
from ds4lib.ref.rope import rope_freqs
from ds4lib.ref.sampling import NonFiniteLogits, check_finite
from ds4lib.roles import layer_roles
from kernels import (attention, compressor, dspark, engram, gemv, hc, im_operand, indexer, moe, prefetch, q4k_gemv,
                     rms_norm, rope, sampling, spec_accept, step, vq_gemv)

__all__ = ["CudaBackend", "CudaState"]

_SCRATCH_BUDGET = 1 << 30          # bytes of per-chunk scratch the prefill chunk size is chosen for
_PRUNE_AT = 64                     # context-dependent scratch entries kept before that dict is cleared
_SCRATCH_ENTRIES = 2048            # fixed-shape scratch entries kept before the dict is cleared
_SIM = bool(_cuda_config.ENABLE_CUDASIM)


_BATCH_GRAPHS = 32                 # captured batched decode steps kept (least recently used dropped first)
CAPTURE_GUESS_S = 0.1              # a batched capture's host time before one of that size was measured
POOL_STATES = 8                    # finished sessions' states kept for reuse, with their decode graphs
_SAMPLE_GRAPHS = 256               # captured samplers kept (per parameter set and logits row)
BUCKET_MIN_ROWS = 512              # the finest step of a decode step's cache views (`_bucket`)
SHARED_EXPERT_AT = ("early", "side", "main")   # where `_moe` runs the shared expert (CudaBackend.shared_expert_at)
L2_PREFETCH = ("wo", "wq")         # what CudaBackend.l2_prefetch may ask L2 for ahead of its reader (class docstring)
NORM_IN_STAGING = True             # the q latent normed in its readers' staging (`_query`; tests compare): only
                                   # where they take q4k_gemv.norm_path, none with q4k_gemv's default IM_FP8_MIN_*
COMBINE_IN_POST = True             # the MoE's combine formed in the ffn's hc_post (`_layer`; tests compare)
STAGE_WO_B = True                  # wo_a stages wo_b's integer-path operands (`_output`; tests compare)
STAGE_SHARED_IN_NORM = True        # the ffn norm stages the shared expert's gate / up operands (`_layer`; tests
                                   # compare)
STAGE_XQ_IN_NORM = True            # the attention norm stages wq_a's and wkv's operands (`_layer`; tests compare)
STAGE_Q_IN_NORM = True             # the q latent's norm stages its readers' operands (`_query`; tests compare)
STAGE_W2_IN_SWIGLU = True          # the shared expert's SwiGLU stages w2's operands (`_shared_expert`; tests compare)


def _flag(name: str, doc: str) -> property:
    """A CudaBackend placement option that is True or False: a property over `_name` whose setter refuses anything
    else with a ValueError naming the option."""
    attr = "_" + name

    def get(self):
        return getattr(self, attr)

    def set_(self, value):
        if not isinstance(value, bool):
            raise ValueError(f"{name} {value!r}: expected True or False")
        setattr(self, attr, value)
    return property(get, set_, doc=doc)


def _bucket(n: int, min_rows: int = BUCKET_MIN_ROWS) -> int:
    """The cache view of a decode step whose owner holds n rows: n rounded up to a multiple of max(min_rows, 1/8 of
    the next power of two), so a long session re-captures its graph every ~1/8 of its length and a short one once
    per min_rows rows (a capture costs about two eager steps of host time: 60-80 ms for ds4-tiny; the kernels that
    scan a view, the indexer's scores and top-k, cost little more for a few hundred masked rows)."""
    if n <= 0:
        return 0
    step_rows = max(int(min_rows), 1 << max(0, (n - 1).bit_length() - 3))
    return -(-n // step_rows) * step_rows


class _Call:
    """One call's host plan (sizes only: kernels read positions from `pos` on the device) and its arrays."""

    def __init__(self, T, p0, decode, feat=None):
        self.T, self.p0, self.decode = T, p0, decode
        self.feat = feat           # float32 [T, n_targets * D]: the call's DSpark context features, or None
        self.topk = {}
        self.cand = None
        self.gmax = {}             # compressor layer -> latent rows of the call (exact, or 1 at decode)
        self.n_after = {}          # compressor layer -> rows once the call is done
        self.view = {}             # compressor layer -> rows its readers see (n_after, or its bucket at decode)
        self.rows = None           # a batched decode step: [(state, its own one-row _Call)] of each row's session
        self.tag = ""              # names the buffers a session's call keeps across layers (top-k, candidates)


class CudaBackend:
    """`shared_expert_at` places the MoE's shared expert (`_moe`; the same kernels over the same inputs, so the same
    bits, only the stream order differs):
    - "early" (default): on the side stream, forked before the routing, so it starts beside the routing (route +
      plan) too;
    - "side": on the side stream, forked after the routing, beside the routed experts;
    - "main": on the main stream after the routing, before the routed experts, serially.
    `ffn_mixes_apart` (default True) runs the FFN's mHC mixes on the mix stream, forked after the FFN's norm and
    joined before its hc_post, beside the whole MoE; False puts them on the side stream ahead of the shared expert
    (from the fork on). On an H100 the defaults took 0.18 ms a V4.1 token less than ("side", False) (BENCHMARKS.md).
    `ffn_mixes_late` (default False; with `ffn_mixes_apart`) forks the FFN's mixes onto the mix stream after the
    routing instead of after the FFN's norm: with `shared_expert_at` "side" the routing then has the GPU to itself
    (beside it the mixes and the shared expert held the SMs its blocks waited for: 20.8 us a call in the step, 8.4
    alone, H200).
    `attn_mixes_early` (default False) runs the attention's mHC mixes on the mix stream, forked right after the
    attention norm (beside the query path: wq_a, the q latent's norm, wq_b) and joined before the attention's
    hc_post; False keeps them on the side stream after the window key, beside the scores and values.
    Neither gained on an H100 (whole V4.1 steps, each alone and both, with `shared_expert_at` "side": all within the
    lease's drift; BENCHMARKS.md, forty-first session), so both stay off.
    `l2_prefetch` (a tuple of L2_PREFETCH's names; empty, the default, until timed) asks L2 for weights on the mix
    stream ahead of the GEMVs that read them (kernels.prefetch; the same bits): "wo" the layer's wo_a and wo_b,
    forked once its query projections are queued (beside the rope, scores and values); "wq" the next layer's wq_a
    and wq_b, forked once the routed experts' gate / up GEMV is queued (beside the rest of the MoE). The mix stream
    is joined before the FFN's hc_post.
    Set them before the first call: a graph captured earlier replays the placement it was captured with."""
    name = "cuda"
    simulated = _SIM               # under the CUDA simulator: nothing compiles (Engine.warm_up skips its run)

    def __init__(self, ctx, gains=None, bias=None, *, weights: CudaWeights | None = None, graphs: bool | None = None,
                 shared_expert_at: str = "early", ffn_mixes_apart: bool = True, attn_mixes_early: bool = False,
                 ffn_mixes_late: bool = False):
        from ds4lib.engine.engine import EngineError
        self.ctx = ctx
        self.cfg = cfg = ctx.cfg
        self.roles = layer_roles(cfg)
        problems = []
        if cfg.score_func != "sqrtsoftplus":
            problems.append(f"score_func {cfg.score_func!r} (the router kernel implements sqrtsoftplus)")
        if cfg.hc_mult != hc.HC:
            problems.append(f"hc_mult {cfg.hc_mult} (the mHC kernels are built for {hc.HC})")
        if cfg.n_heads % attention.HEADS_PER_BLOCK or cfg.head_dim > attention.DH_MAX:
            problems.append(f"{cfg.n_heads} heads of {cfg.head_dim} (multiple of {attention.HEADS_PER_BLOCK}, "
                            f"<= {attention.DH_MAX})")
        if cfg.fp8_block != 32:
            problems.append(f"fp8_block {cfg.fp8_block} (the activation kernels use 32)")
        if problems:
            raise EngineError("the CUDA backend cannot run this model: " + "; ".join(problems))
        try:
            cuda.get_current_device()
        except Exception as e:   # noqa: BLE001 - no driver / no device: a clear refusal
            raise EngineError(f"the CUDA backend needs a GPU: {type(e).__name__}: {e}") from None
        # a second stream for work off the layer's critical path (the window key, the attention's mHC mixes, the
        # shared expert): forked from and joined back into the main stream by events, so a captured step holds them
        # as parallel branches (the FFN's mixes have a third, below);
        # with DS4_CUDA_PRIORITY the main stream at the highest priority and the side stream at the lowest
        sim = _cuda_config.ENABLE_CUDASIM                    # (the simulator runs launches in order anyway)
        self.priority = Env.read().cuda_priority and not sim and cuda_graph.available()
        if self.priority:
            low, high = cuda_graph.priority_range()
            self.stream, self.side = cuda_graph.priority_stream(high), cuda_graph.priority_stream(low)
        else:
            self.stream = cuda.stream()
            self.side = self.stream if sim else cuda.stream()
        self._events = None if sim else (cuda.event(timing=False), cuda.event(timing=False))
        self.scr_side = {}            # the side stream's own scratch (its launchers' counters and partials)
        # a third stream for the FFN's mixes (`ffn_mixes_apart`), beside the routed and the shared expert
        self.mix = self.stream if sim else cuda.stream()
        self._mix_events = None if sim else (cuda.event(timing=False), cuda.event(timing=False))
        self.scr_mix = {}             # the mix stream's scratch
        self.shared_expert_at = shared_expert_at
        self.ffn_mixes_apart = ffn_mixes_apart
        self.attn_mixes_early = attn_mixes_early
        self.ffn_mixes_late = ffn_mixes_late
        self.l2_prefetch = ()
        self.scr = {}                 # scratch of fixed shapes (reused by every call of the same size)
        self.scr_var = {}             # scratch whose shapes follow the context length (pruned)
        self._const = {}              # small constant device arrays (index lists, padding rows)
        self.W = weights if weights is not None else upload_base(cfg, ctx.base, gains or {}, bias or {},
                                                                 stages=cfg.n_all_layers > cfg.n_layers
                                                                 and ctx.dspark)
        self.g, self.L = self.W.g, self.W.L
        self.stages = len(self.L) == cfg.n_all_layers > cfg.n_layers     # the DSpark draft stages are on the device
        targets = sorted(cfg.dspark_target_layer_ids) if self.stages else []
        self.feat_col = {l: i * cfg.dim for i, l in enumerate(targets)}   # a target layer's feature columns
        self.n_feat = len(targets) * cfg.dim
        self.draft = CudaDraft(self) if self.stages else None
        self.weight_bytes = self.W.nbytes
        self.geo = engram_geometry(cfg) if cfg.engram_layer_ids else None
        if self.geo is not None:
            self.pad_cid = int(ctx.token_map[cfg.engram_pad_id])
        self._rope = {}
        self._rope_cap = 0
        self.freqs = {y: rope_freqs(cfg.rope_head_dim, cfg.compress_rope_theta if y else cfg.rope_theta, y,
                                    cfg.original_seq_len, cfg.rope_factor, cfg.beta_fast, cfg.beta_slow)
                      for y in (False, True)}
        self.max_chunk = self._pick_chunk(ctx.prefill_block)
        self.n_split = {}
        if graphs is None:
            graphs = Env.read().cuda_graphs
        self.graphs = bool(graphs) and cuda_graph.available()
        self.pdl = Env.read().cuda_pdl              # the graphs' kernel-to-kernel edges programmatic (kernels.pdl)
        self.bucket_min_rows = BUCKET_MIN_ROWS
        self.stats = {"graph_captures": 0, "graph_replays": 0, "eager_steps": 0, "graph_nodes": 0, "graph_pdl_edges": 0,
                      "sample_graph_replays": 0, "batch_graph_replays": 0, "verify_graph_replays": 0,
                      "draft_graph_replays": 0, "ctx_graph_replays": 0, "rollback_graph_replays": 0,
                      "accept_graph_replays": 0}
        self._sample_graphs = {}     # sampling parameters -> the device sampler over the decode row, captured
        self._batch_graphs = {}      # (rope, B, each session and its bucket) -> a batched decode step, captured
        self._accept_graphs = {}     # (k, sampling parameters, row buffers) -> a round's device acceptance, captured
        self._accept_io = None       # its mapped inputs (seed, first position, bonus step) and output (n, token)
        self._batch_ios = {}         # (kind, B) -> the batched step's fixed inputs and outputs (`_batch_io`)
        self._batch_excess = (None, 0.0)  # the last batched step's key, and the time its rows alone cost beyond one
        self._capture_s = {}         # B -> host seconds of the last capture of a batched step of B rows
        self.batch_capture = "auto"  # "now": capture a new set of sessions at its first step (warm-up, benchmarks)
        self._pool = []              # finished sessions' states, reset and handed out again (`new_state`)
        self.pool_size = POOL_STATES
        self._decode_io()
        self.pool_bytes = self.memory_plan().pool
        self._ratios = {r.layer: r.ratio for r in self.roles[:cfg.n_layers] if r.owns_compressor}
        self._pend_norm = {l: self.L[l]["attn.compressor.norm.weight"] for l, ratio in self._ratios.items()
                           if ratio > 1}

    @property
    def shared_expert_at(self) -> str:
        """Where `_moe` runs the shared expert: one of SHARED_EXPERT_AT (class docstring)."""
        return self._shared_expert_at

    @shared_expert_at.setter
    def shared_expert_at(self, at):
        if at not in SHARED_EXPERT_AT:
            raise ValueError(f"shared_expert_at {at!r}: expected one of {', '.join(SHARED_EXPERT_AT)}")
        self._shared_expert_at = at

    ffn_mixes_apart = _flag("ffn_mixes_apart", "Whether `_layer` runs the FFN's mixes on the mix stream (class "
                            "docstring).")
    ffn_mixes_late = _flag("ffn_mixes_late", "Whether `_layer` forks the FFN's mixes onto the mix stream after the "
                           "routing (class docstring).")
    attn_mixes_early = _flag("attn_mixes_early", "Whether `_layer` runs the attention's mixes on the mix stream from "
                             "the attention norm on (class docstring).")

    @property
    def l2_prefetch(self) -> tuple:
        """Which weights the mix stream asks L2 for ahead of their GEMVs: names of L2_PREFETCH (class docstring)."""
        return self._l2_prefetch

    @l2_prefetch.setter
    def l2_prefetch(self, names):
        names = tuple(names)
        bad = [n for n in names if n not in L2_PREFETCH]
        if bad:
            raise ValueError(f"l2_prefetch {bad[0]!r}: expected names among {', '.join(L2_PREFETCH)}")
        self._l2_prefetch = names

    # ------------------------------------------------------------------ loading
    def _decode_io(self):
        """The fixed buffers a decode step reads its inputs from: (position, token) in host-mapped memory, their
        device copies, and the Engram rows' mapped staging (one table row per hash column and Engram layer)."""
        cfg, s = self.cfg, self.stream
        self.m_in = cuda.mapped_array(2, np.int64)
        self.m_seed, self.m_step = _mapped((1,), np.int64), _mapped((1,), np.int64)   # the captured sampler's inputs
        self.d_pos = cuda.device_array(1, np.int64, stream=s)
        self.d_rep = cuda.device_array(cfg.hc_mult, np.int64, stream=s)
        self.d_dead = cuda.device_array(1, np.uint8, stream=s)
        # a decode step's outputs live as long as the backend: a replayed graph writes them whatever scratch was
        # cleared since its capture (a scratch buffer looked up again after a clear would be a new, unwritten one)
        self.d_logits_decode = cuda.device_array((1, cfg.vocab_size), np.float32, stream=s)
        self.d_feat_decode = cuda.device_array((1, self.n_feat), np.float32, stream=s) if self.n_feat else None
        self.m_engram = {}
        if self.geo is None:
            return
        reader = self.ctx.engram_reader
        for l in self.geo.layer_ids:
            name = layer_prefix(cfg, l) + "engram.embed.weight"
            codes = reader.raw(name)
            scales = reader.raw(name[:-len(".weight")] + ".scale")
            self.m_engram[l] = (_mapped((self.geo.n_cols, codes.shape[1]), np.uint8),
                                _mapped((self.geo.n_cols, scales.shape[1]), np.uint8))

    def _pick_chunk(self, block):
        t = 1 << max(0, int(block) - 1).bit_length()
        while t > 16 and self._chunk_scratch(t) > _SCRATCH_BUDGET:
            t //= 2
        return max(1, min(t, int(block)))

    def _chunk_scratch(self, T):
        """Bytes of the per-chunk temporaries of a T-token call (the larger terms), at full context."""
        cfg = self.cfg
        K, F, D, H, Dh = cfg.n_activated_experts, cfg.moe_inter_dim, cfg.dim, cfg.n_heads, cfg.head_dim
        rows = cfg.window_size + cfg.index_topk
        split = attention._value_splits(1, H, rows)
        attn = T * H * (split * Dh + rows) * 4
        vqb = T * K * (3 * F + D) * 4 + vq_gemv.scratch_bytes(T, D) + vq_gemv.scratch_bytes(T * K, F)
        ratio = min((r for r in cfg.compress_ratios[:cfg.n_layers] if r), default=0)
        idx = T * (self.ctx.context_length // ratio) * 4 if ratio else 0
        act = T * (8 * cfg.hc_mult * D + 4 * H * Dh + 2 * cfg.q_lora_rank) * 4
        fp8 = sum(q4k_gemv.fp8_scratch_bytes(n, k, T) for n, k in (      # on the path each shape takes
            (cfg.q_lora_rank, D), (Dh, D), (H * Dh, cfg.q_lora_rank), (D, cfg.o_groups * cfg.o_lora_rank),
            (F, D), (D, F)) if k % q4k_gemv.QK_K == 0)
        return attn + vqb + idx + act + fp8 + T * cfg.vocab_size * 4

    # ------------------------------------------------------------------ scratch
    def _buf(self, name, shape, dtype=np.float32, var=False):
        d = self.scr_var if var else self.scr
        key = (name, tuple(int(s) for s in shape), np.dtype(dtype).str)
        if key not in d:                 # (the context-dependent dict is pruned between calls only: _plan)
            d[key] = cuda.device_array(key[1], dtype, stream=self.stream)
        return d[key]

    def _bufs(self, name, specs):
        """_buf for each (shape, dtype) of a launcher's specification (e.g. kernels.vq_gemv.stage_shapes): name0, ..."""
        return tuple(self._buf(f"{name}{i}", sh, dt) for i, (sh, dt) in enumerate(specs))

    def _const_arr(self, name, make, stream=None):
        """A constant array, uploaded on first use on `stream` (default the main stream): the stream that reads it
        first, so that its upload is ordered before that read."""
        if name not in self._const:
            self._const[name] = cuda.to_device(make(), stream=self.stream if stream is None else stream)
        return self._const[name]

    def _rope_tables(self, need):
        if need <= self._rope_cap:
            return
        cap = max(4096, 1 << max(0, need - 1).bit_length())
        pos = np.arange(cap, dtype=np.float32)
        for y, f in self.freqs.items():
            ang = np.outer(pos, f).astype(np.float32)                  # as ds4lib.ref.rope.apply_rope
            self._rope[y] = (cuda.to_device(np.cos(ang).astype(np.float32), stream=self.stream),
                             cuda.to_device(np.sin(ang).astype(np.float32), stream=self.stream))
        self._rope_cap = cap

    # ------------------------------------------------------------------ linears
    def _linear(self, x, lin, *, quantize, bf16=True, rpg=None, out=None, fp8=False, side=False, staged=None,
                stage_out=None):
        """x [T, in] float32 (device) -> [T, rows]: linear_q (quantize) / linear_bf16 / linear_f32 of the reference.
        `fp8`: x holds act_quant_fp8 values already (q4_K weights then take a tensor-core path, as with quantize:
        by default the integer one, kernels.q4k_gemv.IM_FP8_MIN_*).
        `side`: on the side stream with its scratch (between `_fork` and `_join`). `staged`: x's integer-path
        operands, written by its producer (`_im_staging`); `stage_out`: the output's, for the next linear
        (kernels.q4k_gemv's `stage_out`)."""
        s, T = (self.side if side else self.stream), x.shape[0]
        if out is None:
            out = self._buf(f"lin{id(lin)}", (T, lin.rows))
        if lin.kind in ("q4_K", "q8_0"):
            return q4k_gemv.q4k_gemv(x, lin.w, kind=lin.kind, quantize=quantize, out_bf16=bf16, rows_per_group=rpg,
                                     out=out, scratch=self.scr_side if side else self.scr, stream=s,
                                     fp8_input=fp8 and not quantize, staged=staged, stage_out=stage_out)
        if staged is not None or stage_out is not None:
            raise ValueError(f"_linear: staged operands for {lin.kind} weights")
        if quantize:                                     # each stream its own buffer: the two may overlap
            x = gemv.act_quant_fp8(x, out=self._buf("lin_xq_side" if side else "lin_xq", tuple(x.shape)), stream=s)
        return gemv.gemv(x, lin.w, out_bf16=bf16, rows_per_group=rpg, out=out, stream=s)

    @staticmethod
    def _after(event, first, then):
        """Work queued on stream `then` from here on starts after everything queued on `first` so far (nothing to do
        where they are one stream: the simulator's, or --one-stream's)."""
        if then is not first:
            event.record(first)
            event.wait(then)

    def _fork(self):
        """The side stream from here on after the main stream so far."""
        self._after(self._events and self._events[0], self.stream, self.side)

    def _join(self):
        """The main stream from here on after the side stream so far."""
        self._after(self._events and self._events[1], self.side, self.stream)

    def _fork_mix(self):
        """The mix stream from here on after the main stream so far."""
        self._after(self._mix_events and self._mix_events[0], self.stream, self.mix)

    def _join_mix(self):
        """The main stream from here on after the mix stream so far."""
        self._after(self._mix_events and self._mix_events[1], self.mix, self.stream)

    def _prefetch(self, what, l, names):
        """When `what` is in l2_prefetch: ask L2 for layer l's weights `names` (those it has, held as file bytes) on
        the mix stream, forked here (and joined with it before the FFN's hc_post)."""
        if what not in self._l2_prefetch:
            return
        ws = [self.L[l][n].w for n in names if n in self.L[l] and self.L[l][n].w.dtype == np.uint8]
        if ws:
            self._fork_mix()
            prefetch.l2_prefetch(ws, stream=self.mix)

    def _aq8(self, x, name):
        return gemv.act_quant_fp8(x, out=self._buf(name, tuple(x.shape)), stream=self.stream)

    # ------------------------------------------------------------------ sessions
    def new_state(self) -> CudaState:
        """An empty session state: a pooled one (`release_state`) reset in place, so the decode graphs captured over
        its buffers replay for the new session, or a new one."""
        if self._pool:
            return cuda_state.reset(self._pool.pop(), self.stream)
        st = cuda_state.new_state(self.cfg, self.roles, self.max_chunk, self.geo is not None, self.stream)
        if self.draft is not None:
            self.draft.add_rings(st)
        return st

    def release_state(self, state):
        """A session the engine is done with (not handed to the prefix cache): kept for `new_state` and `copy_state`
        with its graphs, up to `pool_size` states and `pool_bytes` (default: the memory plan's pool, twice one
        session's state at full context); beyond that its graphs are released and it is dropped."""
        if state.log is not None or any(state is st for st in self._pool):
            return
        held = sum(cuda_state.nbytes(st) for st in self._pool)
        if len(self._pool) < self.pool_size and held + cuda_state.nbytes(state) <= self.pool_bytes:
            self._pool.append(state)
        else:
            self.park_state(state)

    def detach_state(self, state):
        """A finished session's state for the prefix cache: a device copy the cache owns (`clone`: no graphs); the
        state itself goes back to the pool (`release_state`)."""
        kept = cuda_state.clone(state, self.stream)
        self.release_state(state)
        return kept

    # ------------------------------------------------------------------ speculative decoding
    @property
    def can_draft(self) -> bool:
        """The DSpark stages are on the device (speculative.supports)."""
        return self.draft is not None

    def propose(self, state, anchor, start_pos, pick=None):
        """The DSpark proposal after positions <= start_pos with `anchor` at start_pos + 1 (cuda_dspark)."""
        return self.draft.propose(state, anchor, start_pos, pick)

    def accept_rows(self, logits, prop, drafts, params, seed, first_pos):
        """(n kept, next token) of a speculative round decided on the device (kernels.spec_accept, the semantics of
        speculative.verify_rows): the verify call's rows `logits` [k + 1, V], the proposal's draft rows (device), the
        k drafts verified (host ints, written to mapped memory), the request's sampling parameters and seed, the
        first draft's position. Replayed from a graph per (k, parameters, row buffers); the host reads back two
        integers."""
        from ds4lib.engine.speculative import BONUS
        s = self.stream
        k = len(drafts)
        if self._accept_io is None:
            B = self.cfg.dspark_block_size
            self._accept_io = (_mapped((3,), np.int64), _mapped((2,), np.int64), _mapped((max(B, 1),), np.int64))
        m_in, m_out, m_drafts = self._accept_io
        if k > m_drafts.host.shape[0] or tuple(logits.shape) != (k + 1, self.cfg.vocab_size):
            raise ValueError(f"accept_rows: {k} drafts (at most {m_drafts.host.shape[0]}) and logits "
                             f"{tuple(logits.shape)} of k + 1 rows")
        s.synchronize()                                    # a previous replay may still read the mapped inputs
        m_in.host[:] = [int(np.array([int(seed) & (2 ** 64 - 1)], np.uint64).view(np.int64)[0]), int(first_pos),
                        (BONUS << 56) | (int(first_pos) + k)]
        m_drafts.host[:k] = drafts
        drafts = m_drafts.dev
        pkey = (float(params.temperature), int(params.top_k), float(params.top_p), float(params.min_p))
        key = (k,) + pkey + tuple(a.device_ctypes_pointer.value for a in (logits, prop.logits, drafts))

        def run():
            spec_accept.accept(logits, prop.logits, drafts, k, m_in.dev, temperature=pkey[0], top_k=pkey[1],
                               top_p=pkey[2], min_p=pkey[3], out=m_out.dev, scratch=self.scr, stream=s)

        if not self.graphs:
            run()
        else:
            if key not in self._accept_graphs:
                if len(self._accept_graphs) >= _SAMPLE_GRAPHS:
                    self._close_graph(self._accept_graphs.pop(next(iter(self._accept_graphs))))
                graph, ran, _ = self._capture_or_run(run, "a speculative acceptance")
                if graph is not None:
                    graph.keep = [list(self.scr.values()), logits, prop.logits, self._accept_io]
                    self.stats["graph_captures"] += 1
                self._accept_graphs[key] = graph
                if not ran:
                    self._launch_or_run(graph, run)
            else:
                self._launch_or_run(self._accept_graphs[key], run)
        s.synchronize()
        n, tok = int(m_out.host[0]), int(m_out.host[1])
        if tok < 0:
            check_finite(self.to_host(logits))         # raises NonFiniteLogits, naming what the rows hold
            raise NonFiniteLogits("the device acceptance found a non-finite logits row")
        return n, tok

    def _launch_or_run(self, graph, run):
        if graph is not None:
            graph.launch()
            self.stats["accept_graph_replays"] += 1
        else:
            run()

    def append_context(self, state, features, positions):
        """DSpark context rows of fed positions from their features (ForwardOut.features) (cuda_dspark); a decode
        step's row is deferred (copied aside, appended with the next rows before a proposal)."""
        if features is self.d_feat_decode and len(positions) == 1:
            self.draft.defer(state, features, int(positions[0]))
        else:
            self.draft.append_context(state, features, positions)

    # ------------------------------------------------------------------ prefix cache (ds4lib.engine.prefix_cache)
    def copy_state(self, state):
        """A device copy of a session state, for a session resumed from the prefix cache: into a pooled state
        (cuda_state.copy_into: its graphs replay) or a new one (cuda_state.clone: graphs captured on its first
        decode step)."""
        if self._pool:
            return cuda_state.copy_into(self._pool.pop(), state, self.stream)
        return cuda_state.clone(state, self.stream)

    def state_nbytes(self, state) -> int:
        return cuda_state.nbytes(state)

    def state_to_arrays(self, state) -> dict:
        """Named host arrays of a session state (the prefix cache's disk tier; cuda_state.snapshot)."""
        return cuda_state.snapshot(state)

    def state_from_arrays(self, arrays: dict):
        """A new session state from `state_to_arrays`' arrays; ValueError if they are not this backend's layout."""
        return cuda_state.restore(self.new_state(), arrays, self.stream)

    def park_state(self, state):
        """A finished session's state handed to the prefix cache, which only copies it from now on: its decode graphs
        are released, and the batched steps it took part in."""
        for g in state.graphs.values():
            self._close_graph(g)
        state.graphs = {}
        self.release_batches(state)

    def release_batches(self, state):
        """Drop the captured batched steps that point at `state` (a finished session: its graphs hold it)."""
        for key in [k for k in self._batch_graphs if any(part[0] == id(state) for part in k[2:])]:
            self._close_graph(self._batch_graphs.pop(key))

    def mark(self, state):
        """Before a call whose rows may be partly rolled back (cuda_state.mark: snapshots what a call of up to
        dspark_block_size + 1 rows can change). With graphs on the snapshot is lazy: the verify call's graph takes it
        first, at the call's device positions (an eager call takes it before it runs)."""
        return cuda_state.mark(state, self.cfg.dspark_block_size + 1, self.stream, lazy=self.graphs)

    def rollback(self, state, mark, kept_tokens):
        """Keep only the first len(kept_tokens) rows fed since `mark` (cuda_state.rollback). With graphs on, its
        launches (ring slots, incomplete groups) replay a graph captured per (kept, fed) count and logged buffers."""
        kept = np.asarray(kept_tokens, dtype=np.int64)
        hist = mark.hist
        if self.geo is not None and len(kept):
            cids = np.where(kept == self.cfg.image_token_id, -1, self.ctx.token_map[kept]).astype(np.int64)
            _, hist = engram_hashes(cids, hist, self.geo, self.pad_cid)
        cuda_state.rollback(state, mark, len(kept), hist, self._ratios, self._pend_norm, self.cfg.norm_eps,
                            self.stream, launches=self._rollback_launches(state) if self.graphs else None)

    def _rollback_launches(self, st):
        """launches(n, fed) for cuda_state.rollback: `rollback_launches` replayed from a graph per (n, fed) and the
        device buffers the call logged (its positions and compressor rows: a verify graph's, or an eager call's)."""
        def launches(n, fed):
            def run():
                cuda_state.rollback_launches(st, n, fed, self._ratios, self._pend_norm, self.cfg.norm_eps,
                                             self.stream)
            logged = tuple(v.device_ctypes_pointer.value for l, pair in sorted(
                (l, v) for l, v in st.log.items() if l != "pos") for v in pair)
            key = ("rollback", n, fed, st.log["pos"].device_ctypes_pointer.value) + logged
            if key not in st.graphs:
                rb = [k for k in st.graphs if k[0] == "rollback"]
                self._drop_graphs(st, lambda k: k in rb[:-24])        # the (n, fed) pairs of a few call shapes
                graph, ran, _ = self._capture_or_run(run, "a rollback")
                if graph is not None:
                    graph.keep = [st.log["pos"], dict(st.log), st.snap]
                    self.stats["graph_captures"] += 1
                st.graphs[key] = graph
                if ran:
                    return
            graph = st.graphs[key]
            if graph is not None:
                graph.launch()
                self.stats["rollback_graph_replays"] += 1
            else:
                run()
        return launches

    def synthetic_state(self, pos: int, seed: int = 0) -> CudaState:
        """A state as if `pos` tokens had been processed, with pseudo-random cache contents (the real-size
        benchmark's long contexts: decode cost depends on the row counts, not on the values)."""
        cfg, s = self.cfg, self.stream
        st = self.new_state()
        W = cfg.window_size
        st.pos = int(pos)
        for i, l in enumerate(sorted(st.win)):
            step.fill_bits(st.win[l], seed * 1000 + i, 1.0, stream=s)
            slots = np.full(W, -1, dtype=np.int64)
            p = np.arange(max(0, pos - W), pos, dtype=np.int64)
            slots[p % W] = p
            st.ring_pos[l].copy_to_device(slots, stream=s)
        for rows, owner in ((st.ckv, 1), (st.idxk, 2)):
            for l, r in rows.items():
                n = pos // self.roles[l].ratio
                r.reserve(max(n, 1), s)
                step.fill_bits(r.buf, seed * 1000 + 100 * owner + l, 1.0, stream=s)
                r.n = n
        if st.hist is not None:
            rng = np.random.default_rng(seed)
            st.hist[:] = rng.integers(0, cfg.engram_compressed_vocab_size, size=st.hist.shape)
        self.stream.synchronize()
        return st

    # ------------------------------------------------------------------ forward
    def forward(self, state, tokens, last_only=False, observer=None):
        ids = np.asarray(tokens, dtype=np.int64)
        if ids.ndim != 1 or len(ids) == 0:
            raise ValueError("forward needs a non-empty 1-D token list")
        if ids.min() < 0 or ids.max() >= self.cfg.vocab_size:
            raise ValueError(f"token id outside the vocabulary [0, {self.cfg.vocab_size})")
        if len(ids) == 1 and last_only and observer is None and state.log is None:
            logits = self._decode(state, int(ids[0]))
            return ForwardOut(logits, self.d_feat_decode)
        T = len(ids)
        if state.log is not None and not last_only and observer is None and state.calls == 0 \
                and T <= self.cfg.dspark_block_size + 1:
            return self._verify(state, ids)
        logits = None if last_only else cuda.device_array((T, self.cfg.vocab_size), np.float32, stream=self.stream)
        if len(self.scr) > _SCRATCH_ENTRIES:               # many distinct call sizes seen: start afresh
            self.scr.clear()
            self.scr_side.clear()
            self.scr_mix.clear()
        feat = None
        if self.n_feat:                                    # valid until the next call of this size
            feat = self._buf("features", (T, self.n_feat)) if T <= self.max_chunk else \
                cuda.device_array((T, self.n_feat), np.float32, stream=self.stream)
        for s0 in range(0, T, self.max_chunk):
            part = ids[s0:s0 + self.max_chunk]
            last = s0 + self.max_chunk >= T
            want = "all" if not last_only else ("last" if last else "none")
            out = logits[s0:s0 + len(part)] if want == "all" else None
            got = self._chunk(state, part, want, out, observer,
                              feat[s0:s0 + len(part)] if feat is not None else None)
            if want == "last":
                logits = got
        return ForwardOut(logits, feat)

    def _plan(self, st, T, decode):
        """Sizes of a call at the state's position (module docstring); grows the caches it will write. `decode`: the
        sizes a captured graph replays at any position of the bucket (each compressor's latent rows bounded by
        ceil(T / ratio), the readers' views bucketed), else the call's own."""
        if len(self.scr_var) >= _PRUNE_AT:                 # between calls: a capture must find the eager run's buffers
            self.scr_var.clear()
        c = _Call(T, st.pos, decode)
        p0 = st.pos
        for r in self.roles[:self.cfg.n_layers]:
            if not r.owns_compressor:
                continue
            l, ratio = r.layer, r.ratio
            g = (p0 + T) // ratio - p0 // ratio
            c.gmax[l] = -(-T // ratio) if decode else g
            c.n_after[l] = st.ckv[l].n + g
            c.view[l] = _bucket(c.n_after[l], self.bucket_min_rows) if decode else c.n_after[l]
            for rows in (st.ckv, st.idxk):
                if l in rows:
                    rows[l].reserve(max(c.view[l], st.ckv[l].n + c.gmax[l], 1), self.stream)
        return c

    def _commit(self, st, c):
        for l, n in c.n_after.items():
            st.ckv[l].n = n
            if l in st.idxk:
                st.idxk[l].n = n
        st.pos = c.p0 + c.T

    def _chunk(self, st, ids, want, out, observer, feat):
        cfg, s = self.cfg, self.stream
        T, p0 = len(ids), st.pos
        self._rope_tables(p0 + T)
        c = self._plan(st, T, decode=False)
        c.feat = feat
        c.pos = cuda.to_device(np.arange(p0, p0 + T, dtype=np.int64), stream=s)
        rep = cuda.to_device(np.repeat(ids, cfg.hc_mult), stream=s)         # h[t, j] = embed[ids[t]] for every j
        c.dead = cuda.to_device((ids == cfg.image_token_id).astype(np.uint8), stream=s)
        rows = self._engram_host(st, ids)
        c.engram = {}
        for l, (codes, scales) in rows.items():
            c.engram[l] = (cuda.to_device(codes, stream=s), cuda.to_device(scales, stream=s))
        if st.log is not None:                             # a marked call: its positions for a rollback
            if st.snap_pending:
                cuda_state.snapshot_launches(st, p0, s)
            st.log["pos"] = c.pos
            st.calls += 1
        logits = self._body(st, c, rep, want, out, observer)
        self._commit(st, c)
        return logits

    def _decode(self, st, token):
        """One token at st.pos: the bucket's graph replayed, or the same launches made eagerly (module docstring)."""
        s = self.stream
        self._rope_tables(st.pos + 1)
        c = self._plan(st, 1, decode=True)
        c.feat = self.d_feat_decode
        s.synchronize()                                    # the previous step may still read the mapped inputs
        self.m_in[0] = st.pos
        self.m_in[1] = token
        for l, (codes, scales) in self._engram_host(st, np.array([token], dtype=np.int64)).items():
            self.m_engram[l][0].host[:] = codes
            self.m_engram[l][1].host[:] = scales
        c.pos, c.dead = self.d_pos, self.d_dead
        c.engram = {l: (codes.dev, scales.dev) for l, (codes, scales) in self.m_engram.items()}
        key = (self._rope_cap,) + self._graph_key(st, c)
        graph = st.graphs.get(key) if self.graphs else None
        if self.graphs and key not in st.graphs:           # a new bucket: capture first, run eagerly only if needed
            self._drop_graphs(st, lambda k: not isinstance(k[0], str))
            graph, ran = self._capture(st, c)
            st.graphs[key] = graph                         # None: this bucket stays eager
            if ran:                                        # this step already ran eagerly
                self.stats["eager_steps"] += 1
                self._commit(st, c)
                return self.d_logits_decode
        if graph is not None:
            graph.launch()
            self.stats["graph_replays"] += 1
        else:
            self._decode_body(st, c)
            self.stats["eager_steps"] += 1
        self._commit(st, c)
        return self.d_logits_decode

    def _drop_graphs(self, st, which):
        """Close and forget the session's captured graphs whose key satisfies `which` (decode keys start with the RoPE
        capacity, a verify call's with "verify", a proposal's with "draft")."""
        for k in [k for k in st.graphs if which(k)]:
            self._close_graph(st.graphs.pop(k))

    def _verify(self, st, ids):
        """A marked call of T <= dspark_block_size + 1 rows (a speculative round's verification, every row's
        logits): replayed from a graph captured per (T, bucket) on the session's state, like a decode step. The
        call's rows come from host-mapped (position, token) rows and Engram staging (`_batch_io`), the
        compressors' latent rows are bounded by ceil(T / ratio) and the views bucketed (`_plan(decode=True)`):
        the kernels read the positions on the device, so the launches are the same at every position of the
        bucket and the bits those of an eager call. The compressors' FP32 projections the rollback re-applies
        are the buffers the captured launches write; they are logged again at each replay. With graphs off the
        same launches run eagerly over the call's own sizes (nothing is kept to replay; under the simulator a
        bucketed view costs every masked row). Returns ForwardOut(logits [T, V], features [T, F]) in buffers the
        next verify call of T rows overwrites."""
        s, cfg = self.stream, self.cfg
        T = len(ids)
        self._rope_tables(st.pos + T)
        c = self._plan(st, T, decode=self.graphs)          # bounded and bucketed only where a graph is kept
        io = self._batch_io(T, kind="verify")
        s.synchronize()                                    # the previous call may still read the mapped inputs
        io["in"][:, 0] = np.arange(st.pos, st.pos + T)
        io["in"][:, 1] = ids
        n_cols = self.geo.n_cols if self.geo is not None else 0
        for l, (codes, scales) in self._engram_host(st, ids).items():
            io["engram"][l][0].host[:T * n_cols] = codes
            io["engram"][l][1].host[:T * n_cols] = scales
        c.pos, c.dead, c.feat = io["pos"], io["dead"], io["feat"]
        c.engram = {l: (codes.dev, scales.dev) for l, (codes, scales) in io["engram"].items()}
        st.log["pos"] = c.pos
        st.calls += 1
        snap = st.snap_pending                             # a lazy mark: the snapshot is this call's first launches
        st.snap_pending = False
        key = ("verify", self._rope_cap, T, snap) + self._graph_key(st, c)

        def run():
            step.batch_inputs(io["in_dev"], cfg.image_token_id, io["pos"], io["rep"], io["dead"], stream=s)
            if snap:
                cuda_state.snapshot_launches(st, io["pos"], s)
            return self._body(st, c, io["rep"], "all", io["logits"], None)

        ran = False
        if not self.graphs:
            run()
            self.stats["eager_steps"] += 1
            self._commit(st, c)
            return ForwardOut(io["logits"], io["feat"])
        if key not in st.graphs:                           # a new bucket or row count: capture, once
            self._drop_graphs(st, lambda k: k[0] == "verify" and (k[1], k[4:]) != (key[1], key[4:]))
            graph, ran, _ = self._capture_or_run(run, "a verify call")
            if graph is not None:
                graph.keep = self._graph_keep(io)
                graph.log = {l: v for l, v in st.log.items() if l != "pos"}
                self.stats["graph_captures"] += 1
            st.graphs[key] = graph
        graph = st.graphs[key]
        if ran:
            self.stats["eager_steps"] += 1
        elif graph is not None:
            st.log.update(graph.log)
            graph.launch()
            self.stats["graph_replays"] += 1
            self.stats["verify_graph_replays"] += 1
        else:
            run()
            self.stats["eager_steps"] += 1
        self._commit(st, c)
        return ForwardOut(io["logits"], io["feat"])

    def _decode_body(self, st, c):
        step.step_inputs(self.m_in, self.cfg.image_token_id, self.d_pos, self.d_rep, self.d_dead, stream=self.stream)
        return self._body(st, c, self.d_rep, "last", self.d_logits_decode, None)

    # ------------------------------------------------------------------ batched decode
    def decode_batch(self, states, tokens):
        """One token for each of B distinct sessions in one step: the weights' kernels (projections, experts, head)
        run over the B rows at once, what reads or writes a session's state per session (`_attention`). Every kernel
        forms a row's result independently of the other rows, so each row's logits are bit for bit those of its own
        `forward` decode step. Returns the logits [B, V] on the device (overwritten by the next batched step of B
        rows).
        Graphs: a set of sessions (with their buckets) decoded together is captured as one graph and replayed while
        the set lasts (a few dozen kept; states come back from the pool, so a set recurs across requests). A capture
        costs host time (about an eager step of the B rows), so a new set first runs each row's own decode step (its
        own graph; the logits copied into the batch's rows) and is captured once the time those steps took beyond
        one step each, summed over the set's steps in a row, reaches the last measured capture time of B rows
        (ski rental: never more than twice the better choice in hindsight); `batch_capture = "now"` captures at once.
        With graphs off, the batched launches run eagerly."""
        B = len(states)
        if B != len(tokens) or B == 0:
            raise ValueError("decode_batch needs one token per session")
        if len({id(st) for st in states}) != B:
            raise ValueError("decode_batch: a session appears twice in one step")
        ids = np.asarray(tokens, dtype=np.int64)
        if ids.min() < 0 or ids.max() >= self.cfg.vocab_size:
            raise ValueError(f"token id outside the vocabulary [0, {self.cfg.vocab_size})")
        if any(st.log is not None for st in states):
            raise ValueError("decode_batch: a session has an open mark (speculative verification decodes alone)")
        if B == 1:
            return self._decode(states[0], int(ids[0])).reshape(1, -1)
        s = self.stream
        self._rope_tables(max(st.pos for st in states) + 1)
        c = _Call(B, None, True)
        c.rows = []
        for b, st in enumerate(states):
            c_b = self._plan(st, 1, decode=True)
            c_b.tag = f"@{b}"
            c.rows.append((st, c_b))
        io = self._batch_io(B)
        key = (self._rope_cap, B) + tuple((id(st),) + self._graph_key(st, c_b) for st, c_b in c.rows)
        cached = self.graphs and key in self._batch_graphs
        graph = self._batch_graphs.pop(key) if cached else None
        if self.graphs and not cached and self.batch_capture != "now":
            excess = self._batch_excess[1] if self._batch_excess[0] == key else 0.0
            if excess < self._capture_s.get(B, CAPTURE_GUESS_S):     # not yet worth a capture: rows alone
                t = time.perf_counter()
                for b, st in enumerate(states):
                    io["logits"][b:b + 1].copy_to_device(self._decode(st, int(ids[b])), stream=s)
                s.synchronize()
                dt = time.perf_counter() - t
                self._batch_excess = (key, excess + dt * (B - 1) / B)
                return io["logits"]
        s.synchronize()                                    # the previous step may still read the mapped inputs
        io["in"][:, 0] = [st.pos for st in states]
        io["in"][:, 1] = ids
        n_cols = self.geo.n_cols if self.geo is not None else 0
        for b, st in enumerate(states):
            for l, (codes, scales) in self._engram_host(st, ids[b:b + 1]).items():
                io["engram"][l][0].host[b * n_cols:(b + 1) * n_cols] = codes
                io["engram"][l][1].host[b * n_cols:(b + 1) * n_cols] = scales
        c.pos, c.dead = io["pos"], io["dead"]
        for b, (_, c_b) in enumerate(c.rows):
            c_b.pos = c.pos[b:b + 1]
        c.engram = {l: (codes.dev, scales.dev) for l, (codes, scales) in io["engram"].items()}

        def run():
            step.batch_inputs(io["in_dev"], self.cfg.image_token_id, io["pos"], io["rep"], io["dead"], stream=s)
            return self._body(None, c, io["rep"], "all", io["logits"], None)

        ran = False
        if self.graphs and not cached:
            t = time.perf_counter()
            graph, ran, _ = self._capture_or_run(run, "a batched decode step")
            if self.batch_capture != "now":                # (a warm-up's capture includes compiling)
                self._capture_s[B] = time.perf_counter() - t
            self._batch_excess = (None, 0.0)
            if graph is not None:
                graph.keep = self._graph_keep(io, list(states))
                self.stats["graph_captures"] += 1
            if len(self._batch_graphs) >= _BATCH_GRAPHS:   # least recently used first
                self._close_graph(self._batch_graphs.pop(next(iter(self._batch_graphs))))
        if self.graphs:
            self._batch_graphs[key] = graph                # (re)inserted last: most recently used; None stays eager
        if ran:
            self.stats["eager_steps"] += 1
        elif graph is not None:
            graph.launch()
            self.stats["graph_replays"] += 1
            self.stats["batch_graph_replays"] += 1
        else:
            run()
            self.stats["eager_steps"] += 1
        for st, c_b in c.rows:
            self._commit(st, c_b)
        return io["logits"]

    def _graph_key(self, st, c):
        """What a decode step's captured launches depend on besides the backend's buffers: the cache views and the
        device buffers the session's rows live in."""
        return tuple((l, c.view[l], st.ckv[l].buf.shape[0], st.idxk[l].buf.shape[0] if l in st.idxk else 0)
                     for l in sorted(c.view))

    def _batch_io(self, B, kind="batch"):
        """The fixed inputs and outputs of a batched step of B rows, or (kind "verify") of a verify call of B rows (a
        replayed graph reads and writes these): (position, token) rows in host-mapped memory, their device forms,
        the Engram rows' mapped staging, logits, and a verify call's DSpark features."""
        if (kind, B) in self._batch_ios:
            return self._batch_ios[(kind, B)]
        cfg, s = self.cfg, self.stream
        m_in = _mapped((B, 2), np.int64)
        io = {"in": m_in.host, "in_dev": m_in.dev, "pos": cuda.device_array(B, np.int64, stream=s),
              "rep": cuda.device_array(B * cfg.hc_mult, np.int64, stream=s),
              "dead": cuda.device_array(B, np.uint8, stream=s),
              "logits": cuda.device_array((B, cfg.vocab_size), np.float32, stream=s), "engram": {}}
        for l, (codes, scales) in self.m_engram.items():
            io["engram"][l] = (_mapped((B * self.geo.n_cols, codes.host.shape[1]), np.uint8),
                               _mapped((B * self.geo.n_cols, scales.host.shape[1]), np.uint8))
        io["feat"] = cuda.device_array((B, self.n_feat), np.float32, stream=s) \
            if kind == "verify" and self.n_feat else None
        self._batch_ios[(kind, B)] = io
        return io

    @staticmethod
    def _close_graph(graph):
        if graph is not None:
            graph.close()

    def _scratch_dicts(self):
        """Every dict of device arrays that launchers fill on demand (a capture may create entries in any of them)."""
        return (self.scr, self.scr_side, self.scr_mix, self.scr_var, self._const)

    def _graph_keep(self, *extra):
        """What a captured forward's graph must keep alive: every scratch and constant array it may point to, the
        RoPE tables, and the caller's `extra` (its I/O buffers, states)."""
        return [list(d.values()) for d in self._scratch_dicts()] + [dict(self._rope), *extra]

    def _capture_or_run(self, run, what):
        """(graph, ran, result): run()'s launches captured as a graph (nothing runs while capturing: the caller
        launches it), ran False, result None; or, where a launcher created an array while capturing (a process's
        first call, a larger scratch shape: `_try_capture`), run() made eagerly, which creates the arrays for real,
        then captured again right after (before any other call can prune the scratch), ran True and result what the
        eager run returned: the caller takes this call's results from it. graph None: it stays eager (a failed
        capture warns in `_try_capture`; a second retry warns here)."""
        graph, retry = self._try_capture(run, what)
        if not retry:
            return graph, False, None
        result = run()
        graph, retry = self._try_capture(run, what)
        if retry:
            warnings.warn(f"a launcher created an array while {what} was captured right after an eager run; it stays "
                          "eager")
        return graph, True, result

    def _try_capture(self, run, what):
        """(graph, False) with run()'s launches captured, or (None, retry). A launcher that created a scratch or
        constant array while capturing (the dicts grew) makes the graph unusable: the array's initialising copy was
        recorded, not run, and the graph must not outlive memory it points to. Those arrays are dropped again, so
        that the eager run the caller makes instead creates them for real, and retry is True. A capture that failed
        is (None, False), with a warning."""
        dicts = self._scratch_dicts()
        before = [set(d) for d in dicts]
        error = None
        try:
            graph = cuda_graph.StepGraph.capture(self.stream, run, programmatic=self.pdl, node_priority=self.priority)
        except Exception as e:  # noqa: BLE001 - a capture problem costs speed, never a wrong token
            error, graph = e, None
            self.stream.synchronize()
        grew = False
        for d, keys in zip(dicts, before):
            for k in [k for k in d if k not in keys]:
                del d[k]
                grew = True
        if grew:                                           # (a copy that creates an array may also fail a capture)
            if graph is not None:
                graph.close()
            return None, True
        if error is not None:
            warnings.warn(f"CUDA graph capture of {what} failed, it stays eager: {type(error).__name__}: {error}")
        return graph, False

    def _capture(self, st, c):
        """(graph, ran) of `_capture_or_run` for the decode body, the graph keeping every array it points to."""
        graph, ran, _ = self._capture_or_run(lambda: self._decode_body(st, c), "the decode step")
        if graph is not None:
            graph.keep = self._graph_keep(self.m_engram)
            self.stats["graph_captures"] += 1
            self.stats["graph_nodes"] = graph.nodes
            self.stats["graph_pdl_edges"] = graph.pdl_edges
        return graph, ran

    def _body(self, st, c, rep, want, out, observer):
        """Every launch of a call (embedding, layers, head); no host state changes (a decode step's is captured)."""
        cfg, s = self.cfg, self.stream
        T = c.T
        h = self._buf("h", (T, cfg.hc_mult, cfg.dim))
        emb = self.g["embed"]
        q4k_gemv.q4k_rows(emb.w, rep, kind=emb.kind, out=h.reshape(T * cfg.hc_mult, cfg.dim), stream=s)
        c.pre = self._const_arr(("pre0", T, cfg.hc_mult), lambda: np.eye(1, cfg.hc_mult, dtype=np.float32).repeat(T, 0))
        self._engram_decode(c)
        for l in range(cfg.n_layers):
            self._layer(l, st, c, h, observer)
        if want == "none":
            return None
        y = hc.hc_pre(h, c.pre, out=self._buf("y_final", (T, cfg.dim)), stream=s)
        if want == "last":
            y = y[T - 1:]
        yn = rms_norm.rms_norm(y, self.g["norm"], cfg.norm_eps, out=self._buf("yn_final", tuple(y.shape)), stream=s)
        if out is None:                                  # fresh: a caller may hold the previous call's logits
            out = cuda.device_array((1, cfg.vocab_size), np.float32, stream=s)
        return self._linear(yn, self.g["head"], quantize=False, bf16=False, out=out)

    def _engram_host(self, st, ids):
        """Hash the call's tokens on the host (advancing st.hist) and gather their table rows from the memory map:
        {layer: (codes uint8 [T * C, hd], scales uint8 [T * C, hd / 32])}."""
        if self.geo is None:
            return {}
        cfg, geo = self.cfg, self.geo
        tmap = self.ctx.token_map
        cids = np.where(ids == cfg.image_token_id, -1, tmap[ids]).astype(np.int64)
        hashes, st.hist = engram_hashes(cids, st.hist, geo, self.pad_cid)
        reader = self.ctx.engram_reader
        out = {}
        for li, l in enumerate(geo.layer_ids):
            name = layer_prefix(cfg, l) + "engram.embed.weight"
            rows = hashes[:, li, :].reshape(-1)
            out[l] = (np.ascontiguousarray(reader.raw(name)[rows]).view(np.uint8),
                      np.ascontiguousarray(reader.raw(name[:-len(".weight")] + ".scale")[rows]).view(np.uint8))
        return out

    def _engram_decode(self, c):
        """The gathered rows (device or host-mapped) -> c.engram_rows[l] float32 [T, C, hd] on the device."""
        c.engram_rows = {}
        if self.geo is None:
            return
        T, n_cols = c.T, self.geo.n_cols
        ident = self._const_arr(("eg_ident", T, n_cols),
                                lambda: np.arange(T * n_cols, dtype=np.int64).reshape(T, n_cols))
        for li, l in enumerate(self.geo.layer_ids):
            codes, scales = c.engram[l]
            c.engram_rows[l] = engram.engram_gather(ident, codes, scales,
                                                    out=self._buf(f"eg_rows{li}", (T, n_cols, codes.shape[1])),
                                                    stream=self.stream)

    # ------------------------------------------------------------------ one layer
    def _layer(self, l, st, c, h, observer, attend=None):
        """Advance h [T, S, D] and c.pre through layer l (its Engram, then the block); `attend(x) -> y` replaces the
        backbone's attention (the DSpark stages' draft attention)."""
        cfg, s, w, role = self.cfg, self.stream, self.L[l], self.roles[l]
        T, D = c.T, cfg.dim
        if role.engram:
            rows = c.engram_rows[l]
            kv = self._linear(rows.reshape(T, rows.shape[1] * rows.shape[2]), w["engram.wkv.weight"], quantize=True)
            engram.engram_gate(h, kv, w["engram.q_weight"], w["engram.k_weight"], cfg.norm_eps, c.dead, out=h,
                               stream=s)
            if observer:
                observer(l, "engram_out", h.copy_to_host())
        if role.dspark_target and c.feat is not None:
            dspark.dspark_features(h, self.feat_col[l], c.feat, stream=s)
        if observer:
            observer(l, "block_in", h.copy_to_host())
        # the mixes of a sub-layer read h and are first needed by its hc_post (pre: by the next sub-layer's
        # collapse), so they run on the side stream: after the collapse, beside the attention / the routed experts.
        # The attention's mixes go after the side stream's share of the attention (the window key, the compressor),
        # which the attention waits for: not ahead of it
        def mixes(part, out, stream=self.side, scratch=self.scr_side):   # part: "attn" or "ffn"
            hc.hc_mixes(h, w[f"hc_{part}_fn"], w[f"hc_{part}_base"], w[f"hc_{part}_scale"], out=out,
                        norm_eps=cfg.norm_eps, hc_eps=cfg.hc_eps, iters=cfg.hc_sinkhorn_iters, scratch=scratch,
                        stream=stream)
        mix_a = (self._buf("a_pre", (T, 4)), self._buf("a_post", (T, 4)), self._buf("a_comb", (T, 4, 4)))
        x, xq = self._buf("x_attn", (T, D)), self._buf("x_attn_q", (T, D))
        a_im = self._xq_im_staging(l, T) if attend is None else None
        rms_norm.hc_rms_norm(h, c.pre, w["attn_norm.weight"], cfg.norm_eps, out=x, out_q=xq, im=a_im, stream=s)
        self._fork()                                     # after the collapse: it has the GPU to itself
        early = self.attn_mixes_early and attend is None
        if early:                                        # on the mix stream, beside the query path
            self._fork_mix()
            mixes("attn", mix_a, self.mix, self.scr_mix)
        if attend is not None:                           # a draft stage's attention: the mixes first, beside it
            mixes("attn", mix_a)
            y = attend(x)
        else:
            y = self._attention(l, st, c, x, xq, observer, beside=None if early else lambda: mixes("attn", mix_a),
                                xq_im=a_im)
        if observer:
            observer(l, "attn_out", y.copy_to_host())
        self._join()
        if early:
            self._join_mix()
        hc.hc_post(y, h, mix_a[1], mix_a[2], out=h, stream=s)
        mix_f = (self._buf("f_pre", (T, 4)), self._buf("f_post", (T, 4)), self._buf("f_comb", (T, 4, 4)))
        x, xq = self._buf("x_ffn", (T, D)), self._buf("x_ffn_q", (T, D))
        staged = self._bufs("x_ffn_vq", vq_gemv.stage_shapes(T, D))
        sh_im = self._shared_im_staging(l, T)
        rms_norm.hc_rms_norm(h, mix_a[0], w["ffn_norm.weight"], cfg.norm_eps, out=x, out_q=xq, vq=staged, im=sh_im,
                             stream=s)
        if self.ffn_mixes_apart:                         # on the mix stream, beside the whole MoE (or, late,
            def mixes_apart():                           # beside the routed experts)
                self._fork_mix()
                mixes("ffn", mix_f, self.mix, self.scr_mix)
            if not self.ffn_mixes_late:
                mixes_apart()
            terms = self._moe(l, c, x, xq, observer, staged=staged, sh_staged=sh_im,
                              after_route=mixes_apart if self.ffn_mixes_late else None)
        else:                                            # on the side stream, ahead of the shared expert
            terms = self._moe(l, c, x, xq, observer, staged=staged, sh_staged=sh_im,
                              beside=lambda: mixes("ffn", mix_f))
        if self.ffn_mixes_apart or self._l2_prefetch:    # the mixes and the prefetches are done
            self._join_mix()
        if observer or not COMBINE_IN_POST:               # the combine on its own (the observer reads its output)
            y = vq_gemv.moe_combine(*terms, out=self._buf("moe_y", (T, D)), stream=s)
            if observer:
                observer(l, "moe_out", y.copy_to_host())
            hc.hc_post(y, h, mix_f[1], mix_f[2], out=h, stream=s)
        else:
            hc.hc_post(None, h, mix_f[1], mix_f[2], out=h, moe=terms, stream=s)
        c.pre = mix_f[0]
        if observer:
            observer(l, "block_out", h.copy_to_host())
            observer(l, "block_pre", c.pre.copy_to_host())

    # ------------------------------------------------------------------ attention
    def _attention(self, l, st, c, x, xq, observer, beside=None, xq_im=None):
        """The layer's attention over x [T, D] (xq: its act_quant_fp8 values; `xq_im`: xq as wq_a's and wkv's
        integer-path operands, written by the norm: `_xq_im_staging`): the projections over all T rows at once;
        what reads or writes a session's state (window ring, compressor, indexer, sparse attention) per session,
        over its own rows (a batched decode step: one row of each session in c.rows). `beside()` (launches of the
        caller's, between its `_fork` and `_join`) goes on the side stream after the side stream's share of the
        attention, once the main stream has joined that share: the attention does not wait for it."""
        cfg = self.cfg
        T, H, dh = c.T, cfg.n_heads, cfg.head_dim
        # beside the query path, on the side stream after the sub-layer's mixes: the window key and, for one
        # session's rows, its window rows and the compressor (they read x and xq only; the indexer needs the query
        # latent)
        kvq = self._window_kv(l, c, xq, side=True, staged=xq_im)
        win_idx = wts = None
        if c.rows is None:
            win_idx = self._window_rows(l, st, c, kvq, side=True)
            if self.roles[l].ratio and self.roles[l].owns_compressor:
                self._compressor(l, st, c, x, side=True)
            if self.roles[l].ratio and self.roles[l].owns_indexer:     # the indexer's head weights read x only
                wts = self._index_weights(l, x, side=True)
        xq, qr, q3 = self._query(l, c, x, xq, staged=xq_im)
        self._prefetch("wo", l, ("attn.wo_a.weight", "attn.wo_b.weight"))
        self._join()
        if beside is not None:
            beside()
        staged = None
        if c.rows is None:
            staged = self._im_staging(l, T)          # the output projection's operands, from the combine kernel
            o = self._attend_session(l, st, c, x, xq, qr, q3, kvq, None, observer, win_idx=win_idx, wts=wts,
                                     im_stage=staged)
        else:
            o = self._buf("attn_o_rows", (T, H, dh))
            for b, (st_b, c_b) in enumerate(c.rows):
                r = slice(b, b + 1)
                self._attend_session(l, st_b, c_b, x[r], xq[r], (qr[0][r], qr[1], None), q3[r], kvq[r], o[r],
                                     observer)
        return self._output(l, c, o, staged=staged)

    def _im_staging(self, l, T):
        """Buffers for the attention output's integer-path operands [T, H * Dh] when layer l's wo_a takes that path
        (kernels.q4k_gemv.im_path), else None: the combine kernel writes them and wo_a launches no staging."""
        cfg, lin = self.cfg, self.L[l]["attn.wo_a.weight"]
        kx, rpg = cfg.n_heads * cfg.head_dim, cfg.o_lora_rank
        if not q4k_gemv.im_path(lin.kind, lin.rows, lin.k, rpg, quantize=False):
            return None
        return self._bufs("attn_o_im", im_operand.im_stage_shapes(T, kx))

    def _xq_im_staging(self, l, T):
        """Buffers for the attention norm's FP8 output [T, D] staged as wq_a's and wkv's integer-path operands when
        either takes that path (kernels.q4k_gemv.im_path for FP8 input: by default every q4_K shape), else None (or
        with STAGE_XQ_IN_NORM off): the norm writes them and those GEMVs launch no staging (`_staged_for` gives them
        to each that takes the path). The side stream (wkv) reads them between the fork and the join; the next
        layer's attention norm writes them after the join."""
        w = self.L[l]
        return self._im_operands("x_attn_im", STAGE_XQ_IN_NORM, (w["attn.wq_a.weight"], w["attn.wkv.weight"]), T,
                                 self.cfg.dim)

    def _im_operands(self, name, on, readers, T, kx):
        """Buffers `name` for an FP8-valued input [T, kx] staged by the kernel that makes it as its readers'
        integer-path operands, when `on` (a STAGE_* flag) and a reader takes that path (`_im_fp8`), else None."""
        if not (on and any(self._im_fp8(lin) for lin in readers)):
            return None
        return self._bufs(name, im_operand.im_stage_shapes(T, kx))

    @staticmethod
    def _im_fp8(lin):
        """Whether a linear of FP8-valued input takes the integer path (kernels.q4k_gemv.im_path; q4_K only)."""
        return q4k_gemv.im_path(lin.kind, lin.rows, lin.k, quantize=False, fp8_input=True)

    def _staged_for(self, lin, staged):
        """`staged` where lin takes the integer path for FP8 input (`_im_fp8`), else None (its GEMV then stages
        nothing or takes another path)."""
        return staged if staged is not None and self._im_fp8(lin) else None

    def _shared_im_staging(self, l, T):
        """Buffers for the ffn norm's FP8 output [T, D] staged as the shared expert's gate / up operands when that
        GEMV takes the integer path (kernels.q4k_gemv.im_path for FP8 input: by default every shape), else None (or
        with STAGE_SHARED_IN_NORM off): the norm writes them and the GEMV launches no staging. The side stream reads
        them between the fork and the join; the next layer's norm writes them after the join."""
        return self._im_operands("x_ffn_im", STAGE_SHARED_IN_NORM, (self.L[l][SHARED_W13],), T, self.cfg.dim)

    def _window_rows(self, l, st, c, kvq, side=False):
        """One session's window keys kvq [T, Dh] written past the ring of layer l, and the window rows its queries
        read -> [T, W] int32; `side`: on the side stream (between `_fork` and `_join`)."""
        s, W = (self.side if side else self.stream), self.cfg.window_size
        rows = self._const_arr(("win_rows", c.T), lambda: np.arange(W, W + c.T, dtype=np.int64), stream=s)
        attention.cache_write(kvq, rows, st.win[l], stream=s)
        return attention.window_indices(st.ring_pos[l], c.pos, out=self._buf("win_idx", (c.T, W), np.int32),
                                        stream=s)

    def _attend_session(self, l, st, c, x, xq, qr, q3, kvq, out, observer, win_idx=None, wts=None, im_stage=None):
        """One session's rows of a layer's attention: window ring written and read (`_window_rows`), compressed
        rows and top-k (`_compress`), sparse attention -> [T, H, Dh] (into `out` when given). `win_idx`: the
        window rows and the compressor's work done already, on the side stream (`_attention`); `wts`: the
        indexer's head weights, computed there too."""
        cfg, role = self.cfg, self.roles[l]
        T, dh, W = c.T, cfg.head_dim, cfg.window_size
        buf = st.win[l]
        early = win_idx is not None
        if not early:
            win_idx = self._window_rows(l, st, c, kvq)
        cmp_keys = cmp_idx = None
        if role.ratio:
            self._compress(l, st, c, x, qr, observer, run_compressor=not early, wts=wts)
            cmp_idx = c.topk[role.idx_src]
            n_view = c.view[role.kv_src]
            cmp_keys = st.ckv[role.kv_src].view(n_view) if n_view else \
                self._const_arr(("no_ckv", dh), lambda: np.zeros((1, dh), np.uint16))
        return self._attend(l, q3, buf[:W + T], win_idx, cmp_keys, cmp_idx, c.pos, out=out,
                            window=(kvq, c.pos, buf[:W], st.ring_pos[l]), im_stage=im_stage)

    def _query(self, l, c, x, xq=None, staged=None):
        """x [T, D] (xq: its FP8 values, or None to quantise here; `staged`: xq's integer-path operands from the norm,
        `_xq_im_staging`) -> (FP8 x, q latent, queries [T, H, Dh]) (ref attention.query_path, but for the queries'
        RoPE: `_attend` has the score kernel rotate them). The q latent (`_latent`'s argument) is the q_norm's input
        with its weight, normed in the staging of each GEMV that reads it where every reader of the layer takes
        kernels.q4k_gemv.norm_path (no norm launch), else the FP8 values of the normed latent, with their
        integer-path operands where a reader takes that path (the norm stages them: STAGE_Q_IN_NORM). With
        kernels.q4k_gemv's default IM_FP8_MIN_* no reader takes norm_path (wq_b takes the integer path:
        BENCHMARKS.md, thirty-seventh session), so every layer launches the norm, which stages wq_b's operands;
        raised (probes), V4.1's 32 layers without an indexer, whose wq_b alone reads the latent, norm it in wq_b's
        staging."""
        cfg, s, w = self.cfg, self.stream, self.L[l]
        T, H, dh = c.T, cfg.n_heads, cfg.head_dim
        if xq is None:
            xq, staged = self._aq8(x, "x_attn_q"), None
        wq_a = w["attn.wq_a.weight"]
        qa = self._linear(xq, wq_a, quantize=False, fp8=True, out=self._buf("qa", (T, cfg.q_lora_rank)),
                          staged=self._staged_for(wq_a, staged))
        readers = [w["attn.wq_b.weight"]]
        if self.roles[l].ratio and self.roles[l].owns_indexer:
            readers.append(w["attn.indexer.wq_b.weight"])
        if NORM_IN_STAGING and all(q4k_gemv.norm_path(lin.kind, lin.rows, lin.k) for lin in readers):
            qr = (qa, w["attn.q_norm.weight"], None)
        else:
            qrq = self._buf("qr_q", (T, cfg.q_lora_rank))         # only the FP8 values of the normed latent are read
            q_im = self._im_operands("qr_im", STAGE_Q_IN_NORM, readers, T, cfg.q_lora_rank)
            rms_norm.rms_norm(qa, w["attn.q_norm.weight"], cfg.norm_eps, out=self._buf("qr", (T, cfg.q_lora_rank)),
                              out_q=qrq, im=q_im, stream=s)
            qr = (qrq, None, q_im)
        q = self._latent(qr, w["attn.wq_b.weight"], out=self._buf("q", (T, H * dh)))
        return xq, qr, q.reshape(T, H, dh)

    def _latent(self, qr, lin, out):
        """A linear of the normed q latent: qr = (q_norm's input, its weight, None) from `_query` (the GEMV norms it in
        its staging: kernels.q4k_gemv's `norm`) or (its FP8 values, None, their integer-path operands or None)."""
        x, nw, q_im = qr
        if nw is None:
            return self._linear(x, lin, quantize=False, fp8=True, out=out, staged=self._staged_for(lin, q_im))
        return q4k_gemv.q4k_gemv(x, lin.w, kind=lin.kind, quantize=True, out=out, scratch=self.scr, stream=self.stream,
                                 norm=(nw, self.cfg.norm_eps))

    def _window_kv(self, l, c, xq, side=False, staged=None):
        """FP8 x [T, D] -> the window rows' FP8-valued keys [T, Dh] (ref attention.window_kv); `side`: on the side
        stream (between `_fork` and `_join`); `staged`: xq's integer-path operands (`_xq_im_staging`)."""
        cfg, s, w = self.cfg, (self.side if side else self.stream), self.L[l]
        T, dh = c.T, cfg.head_dim
        cos, sin = self._rope[self.roles[l].yarn]
        wkv = w["attn.wkv.weight"]
        kv = self._linear(xq, wkv, quantize=False, fp8=True, out=self._buf("kv", (T, dh)), side=side,
                          staged=self._staged_for(wkv, staged))
        kvq = self._buf("kvq", (T, dh))
        rms_norm.rms_norm_rope_q(kv, w["attn.kv_norm.weight"], cfg.norm_eps, c.pos, cos, sin,
                                 self._buf("kvn", (T, dh)), kvq, stream=s)
        return kvq

    def _attend(self, l, q3, keys, win_idx, cmp_keys, cmp_idx, pos, out=None, window=None, im_stage=None):
        """Sparse attention of the unrotated queries q3 [T, H, Dh] at positions `pos`: the score kernel rotates them
        (RoPE) as it stages them, and the output leaves rotated back (inverse RoPE). `window` = (kv, positions, ring,
        ring_pos): the window ring written after the attention read it (erratum E2), by its last kernel; `im_stage`:
        the output staged by that kernel for wo_a's integer path (`_im_staging`)."""
        H, dh = self.cfg.n_heads, self.cfg.head_dim
        cos, sin = self._rope[self.roles[l].yarn]
        T = q3.shape[0]
        n_rows = win_idx.shape[1] + (cmp_idx.shape[1] if cmp_idx is not None else 0)
        split = self.n_split.setdefault(n_rows, attention._value_splits(1, H, n_rows))
        return attention.sparse_attention(q3, keys, win_idx, cmp_keys, cmp_idx, self.L[l]["attn.attn_sink"],
                                          dh ** -0.5, out=self._buf("attn_o", (T, H, dh)) if out is None else out,
                                          n_split=split, inverse_rope=(pos, cos, sin), rope_q=(pos, cos, sin),
                                          window=window, im_stage=im_stage,
                                          scratch=self.scr, stream=self.stream)

    def _output(self, l, c, o, staged=None):
        """Attention output [T, H, Dh], already rotated back by `_attend` -> [T, D]: wo_a per group, wo_b (ref
        output_projection). `staged`: o's integer-path operands for wo_a, written by the attention (`_im_staging`).
        One token whose wo_a and wo_b both take the integer path (kernels.q4k_gemv.stage_out_path; V4.1): wo_a
        stages its output as wo_b's operands itself (`stage_out`), and wo_b launches no staging."""
        cfg, w = self.cfg, self.L[l]
        T, H, dh = c.T, cfg.n_heads, cfg.head_dim
        wo_a, wo_b = w["attn.wo_a.weight"], w["attn.wo_b.weight"]
        n_u = cfg.o_groups * cfg.o_lora_rank
        st_b = None
        if STAGE_WO_B and q4k_gemv.stage_out_path(wo_a.kind, wo_a.rows, wo_a.k, cfg.o_lora_rank, T, quantize=False) \
                and q4k_gemv.im_path(wo_b.kind, wo_b.rows, wo_b.k, quantize=True):
            st_b = self._bufs("wo_b_im", im_operand.im_stage_shapes(T, n_u))
        u = self._linear(o.reshape(T, H * dh), wo_a, quantize=False, rpg=cfg.o_lora_rank,
                         out=self._buf("wo_a", (T, n_u)), staged=staged, stage_out=st_b)
        return self._linear(u, wo_b, quantize=True, out=self._buf("attn_y", (T, cfg.dim)), staged=st_b)

    def _compressor(self, l, st, c, x, side=False):
        """The compressor of layer l (a KV source) over x [T, D]: its projections, the pooled latents of the groups
        the call completes, written RoPE'd and quantised to the compressed cache (and the indexer's keys where it
        owns them); reads x, the positions and its own state only. `side`: on the side stream with its scratch
        (between `_fork` and `_join`)."""
        cfg, w, role = self.cfg, self.L[l], self.roles[l]
        s = self.side if side else self.stream
        T, dh, ratio = c.T, cfg.head_dim, role.ratio
        cos, sin = self._rope[role.yarn]
        n_g = c.gmax[l]                           # 0: the call completes no group (the state still moves)
        if ratio == 1:
            kvc = self._linear(x, w["attn.compressor.wkv.weight"], quantize=False, out=self._buf("ckv", (T, dh)),
                               side=side)
            lat = compressor.compress(kvc, None, None, None, c.pos, 1, w["attn.compressor.norm.weight"],
                                      cfg.norm_eps, n_g, out=self._buf("lat", (n_g, dh)), stream=s)
        else:
            own = st.log is not None              # a marked call keeps its rows for a rollback
            kvc = self._linear(x, w["attn.compressor.wkv.weight"], quantize=False, bf16=False,
                               out=self._buf(f"ckv{l}" if own else "ckv", (T, dh)), side=side)
            sc = self._linear(x, w["attn.compressor.wgate.weight"], quantize=False, bf16=False,
                              out=self._buf(f"csc{l}" if own else "csc", (T, dh)), side=side)
            if own:
                st.log[l] = (kvc, sc)
            lat = compressor.compress(kvc, sc, st.pend_kv[l], st.pend_sc[l], c.pos, ratio,
                                      w["attn.compressor.norm.weight"], cfg.norm_eps, n_g,
                                      out=self._buf("lat", (n_g, dh)), stream=s)
        if n_g:
            slots, gpos = self._buf("c_rows", (n_g,), np.int64), self._buf("c_gpos", (n_g,), np.int64)
            step.group_rows(c.pos, ratio, slots, gpos, stream=s)
            if role.indexer_owns_k:
                di = cfg.index_head_dim
                k = self._linear(lat, w["attn.indexer.wk.weight"], quantize=False, out=self._buf("ik", (n_g, di)),
                                 side=side)
                kn = rms_norm.rms_norm(k, w["attn.indexer.k_norm.weight"], cfg.norm_eps,
                                       out=self._buf("ikn", (n_g, di)), stream=s)
                rope.rope(kn, gpos, cos, sin, stream=s)
                attention.cache_write(gemv.act_quant_fp4_pow2(kn, out=self._buf("ikq", (n_g, di)), stream=s),
                                      slots, st.idxk[l].buf, stream=s)
            rope.rope(lat, gpos, cos, sin, stream=s)
            attention.cache_write(gemv.act_quant_fp4_e4m3(lat, out=self._buf("latq", (n_g, dh)), stream=s),
                                  slots, st.ckv[l].buf, stream=s)

    def _index_weights(self, l, x, side=False):
        """The indexer's per-head weights of layer l: weights_proj(x) [T, nI] (BF16 values; `side`: on the side
        stream, between `_fork` and `_join`)."""
        return self._linear(x, self.L[l]["attn.indexer.weights_proj.weight"], quantize=False,
                            out=self._buf("iw", (x.shape[0], self.cfg.index_n_heads)), side=side)

    def _compress(self, l, st, c, x, qr, observer, run_compressor=True, wts=None):
        """Compressor (KV sources, `_compressor`; `run_compressor=False`: it has run already) and indexer (index
        sources) of a compressed layer; sets c.topk[l]. `wts`: the indexer's head weights (`_index_weights`) when
        they are computed already."""
        cfg, s, w, role = self.cfg, self.stream, self.L[l], self.roles[l]
        T, ratio = c.T, role.ratio
        cos, sin = self._rope[role.yarn]
        if role.owns_compressor and run_compressor:
            self._compressor(l, st, c, x)
        if not role.owns_indexer:
            return
        k_top = cfg.index_topk
        S = c.view[role.kv_src]
        topk = self._buf(f"topk{l}{c.tag}", (T, k_top), np.int32)      # read by later layers: one per session
        if c.n_after[role.kv_src] == 0:                   # nothing compressed yet: no compressed rows
            topk.copy_to_device(self._const_arr(("no_topk", T, k_top),
                                                lambda: np.full((T, k_top), -1, dtype=np.int32)), stream=s)
            c.topk[l] = topk
            if role.publishes_candidates:
                c.cand = None
            return
        keys = st.idxk[role.kv_src].view(S)
        nI, di = cfg.index_n_heads, cfg.index_head_dim
        qi = self._latent(qr, w["attn.indexer.wq_b.weight"], out=self._buf("iq", (T, nI * di)))
        qi3 = qi.reshape(T, nI, di)
        rope.rope(qi3, c.pos, cos, sin, stream=s)
        qiq = gemv.act_quant_fp4_pow2(qi3, out=self._buf("iqq", (T, nI, di)), stream=s)
        if wts is None:
            wts = self._index_weights(l, x)
        cand = c.cand if role.consumes_candidates else None
        sc = indexer.index_scores(qiq, wts, np.float32(di ** -0.5 * nI ** -0.5), keys, c.pos, ratio,
                                  cand=cand, cand_block=cfg.candidate_block_size,
                                  out=self._buf("iscore", (T, S), var=True), scratch=self.scr_var, stream=s)
        if observer:
            observer(l, "index_scores", sc.copy_to_host())
        if role.publishes_candidates:
            nb = -(-S // cfg.candidate_block_size)
            c.cand = indexer.candidate_blocks(sc, c.pos, ratio, cfg.candidate_topk_blocks, cfg.candidate_block_size,
                                              out=self._buf("cand" + c.tag, (T, nb), np.uint8, var=True),
                                              scratch=self.scr_var, stream=s)
            if observer:
                keep = np.repeat(c.cand.copy_to_host().astype(bool), cfg.candidate_block_size, axis=1)[:, :S]
                observer(l, "candidates", keep)
        c.topk[l] = indexer.select_topk(sc, k_top, positions=c.pos, ratio=ratio, out=topk, scratch=self.scr_var,
                                        stream=s)
        if observer:
            observer(l, "topk", topk.copy_to_host().astype(np.int64))

    # ------------------------------------------------------------------ MoE
    def _moe(self, l, c, x, xq, observer, beside=None, staged=None, sh_staged=None, after_route=None):
        """The layer's MoE over x [T, D] (xq: its act_quant_fp8 values; `staged`: xq as the VQ GEMV's B operand,
        written by the norm that made xq, else staged by the gate / up call; `sh_staged`: xq as the shared expert's
        gate / up integer-path operand, likewise (`_shared_im_staging`)): routing (with the expert plan for one
        token), the VQ experts with SwiGLU folded into the down projection's staging, the shared expert
        (`_shared_expert`) placed by `shared_expert_at` (class docstring), `beside()` (launches of the caller's) on
        the side stream from the fork on, `after_route()` (the caller's) once the routing is queued -> the combine's
        terms (ye, ids, shared) of kernels.vq_gemv.moe_combine, which the caller's hc_post forms (`_layer`). The side
        stream's work reads only xq, h and weights, and writes only its own buffers and scratch: the routing may run
        beside it ("early")."""
        cfg, s, w, role = self.cfg, self.stream, self.L[l], self.roles[l]
        T, D, F, K = c.T, cfg.dim, cfg.moe_inter_dim, role.top_k
        E = w["vq_experts"]

        def fork(shared):                                # the side stream's work: `beside`, then the shared expert
            self._fork()
            if beside is not None:
                beside()
            return self._shared_expert(l, T, xq, side=True, staged=sh_staged) if shared else None

        at = self.shared_expert_at
        if at == "early":
            ysh = fork(True)                             # beside the routing too
        rout = (self._buf("r_scores", (T, E)), self._buf("r_ids", (T, K), np.int32), self._buf("r_w", (T, K)))
        key = ("plan", T, E, K)
        plan = self._const.get(key)
        if plan is None:
            plan = self._const[key] = vq_gemv.vq_plan_buffers(T, K, E, stream=s)
        moe.route(x, w["ffn.gate.weight"].w, w["ffn.gate.bias"], K, cfg.route_scale, gate_temp=cfg.gate_temp,
                  normalise=cfg.norm_topk_prob, out=rout, plan=plan if T == 1 else None, scratch=self.scr, stream=s)
        _, ids, rw = rout
        plan = plan._replace(ids=ids) if T == 1 else vq_gemv.vq_plan(ids, E, tile_rows=plan.tile_rows, out=plan,
                                                                      stream=s)
        if after_route is not None:
            after_route()
        if at == "side":
            ysh = fork(True)                             # after the routing, beside the routed experts
        elif at == "main":
            fork(False)
            ysh = self._shared_expert(l, T, xq, side=False, staged=sh_staged)   # serially, before the routed ones
        vq = (w["vq_cb"], w["vq_index"], w["vq_plane"], w["vq_gains"])
        gu = vq_gemv.vq_gemv(xq, plan, *vq, mats=(0, 2), shape=(F, D), x_div=K, quantize=False, staged=staged,
                             out=self._buf("vq_gu", (2, T * K, F)), scratch=self.scr, stream=s)
        if l + 1 < cfg.n_layers:                         # the next layer's query projections, beside the rest
            self._prefetch("wq", l + 1, ("attn.wq_a.weight", "attn.wq_b.weight"))
        ye = vq_gemv.vq_gemv(gu[0], plan, *vq, mats=(1,), shape=(D, F), x_div=1, scale=w["vq_scale"], quantize=True,
                             swiglu=(gu[1], rw.reshape(T * K), cfg.swiglu_limit),
                             out=self._buf("vq_ye", (1, T * K, D)), scratch=self.scr, stream=s)
        self._join()                                     # the shared expert and `beside` are done
        if observer:
            scores, ids_h, wts = (rout[0].copy_to_host(), ids.copy_to_host().astype(np.int64), rw.copy_to_host())
            observer(l, "router_scores", scores)
            observer(l, "router_ids", ids_h)
            observer(l, "router_weights", wts)
            ye_h = ye[0].copy_to_host().reshape(T, K, D)
            observer(l, "ye", ye_h / np.where(wts == 0, 1, wts)[:, :, None])
            observer(l, "ysh", ysh.copy_to_host())
        return ye[0], ids, ysh

    def _shared_expert(self, l, T, xq, side, staged=None):
        """Layer l's shared expert over xq [T, D] (act_quant_fp8 values) -> [T, D]: gate and up in one GEMV, SwiGLU
        writing the down projection's FP8 input, the down projection; on the side stream with its scratch (`side`,
        between `_fork` and `_join`) or on the main stream with its own. The same buffers either way. `staged`: xq as
        the gate / up GEMV's integer-path operands, written by the ffn norm (`_shared_im_staging`)."""
        cfg, w, F = self.cfg, self.L[l], self.cfg.moe_inter_dim
        gu = self._linear(xq, w[SHARED_W13], quantize=False, fp8=True, out=self._buf("sh_gu", (T, 2 * F)), side=side,
                          staged=staged)
        a_q, w2 = self._buf("sh_aq", (T, F)), w["ffn.shared_experts.w2.weight"]
        a_im = self._im_operands("sh_a_im", STAGE_W2_IN_SWIGLU, (w2,), T, F)   # staged by the SwiGLU
        moe.swiglu(gu[:, :F], gu[:, F:], cfg.swiglu_limit, out=self._buf("sh_a", (T, F)), out_q=a_q, im=a_im,
                   scratch=self.scr_side if side else self.scr, stream=self.side if side else self.stream)
        return self._linear(a_q, w2, quantize=False, fp8=True, out=self._buf("sh_y", (T, cfg.dim)), side=side,
                            staged=a_im)

    # ------------------------------------------------------------------ host side
    def to_host(self, logits):
        return logits if isinstance(logits, np.ndarray) else logits.copy_to_host()

    def sample(self, logits, params, seed, step, mask=None) -> int:
        """`mask`: int32 token bitmask [ceil(V / 32)] of a constrained step, uploaded and read by the sampling
        kernels; None takes the unmasked path."""
        s = self.stream
        V = self.cfg.vocab_size
        if isinstance(logits, np.ndarray):
            logits = cuda.to_device(np.ascontiguousarray(logits, dtype=np.float32), stream=s)
        lg = logits.reshape(1, V)
        seed64 = int(np.array([int(seed) & (2 ** 64 - 1)], dtype=np.uint64).view(np.int64)[0])
        if mask is None and self.graphs and self._graph_row(lg) is not None:
            tok = self._sample_decode_row(lg, params, seed64, int(step))
        else:
            seeds = cuda.to_device(np.array([seed64], dtype=np.int64), stream=s)
            steps = cuda.to_device(np.array([int(step)], dtype=np.int64), stream=s)
            d_mask = None
            if mask is not None:
                words = np.ascontiguousarray(mask, dtype=np.int32).reshape(1, -1)
                d_mask = self._buf("token_mask", words.shape, np.int32)
                d_mask.copy_to_device(words, stream=s)
            tok = self._sample_launch(lg, params, seeds, steps, d_mask)
        t = int(tok.copy_to_host()[0])
        if t < 0:
            check_finite(logits.copy_to_host())        # raises NonFiniteLogits, naming what the row holds
            raise NonFiniteLogits("the device sampler found a non-finite logits row")
        return t

    def _sample_launch(self, lg, params, seeds, steps, d_mask=None):
        return sampling.sample(lg, seeds, steps, temperature=float(params.temperature), top_k=int(params.top_k),
                               top_p=float(params.top_p), min_p=float(params.min_p), mask=d_mask,
                               out=self._buf("token", (1,), np.int64), scratch=self.scr, stream=self.stream)

    def _graph_row(self, lg):
        """The backend-owned buffer holding the logits row `lg` [1, V] (the decode step's, or a row of a batched
        step's), or None: the sampler over such a row can be captured, its address being fixed."""
        if tuple(lg.shape) != (1, self.cfg.vocab_size):
            return None
        ptr = lg.device_ctypes_pointer.value
        d = self.d_logits_decode
        if ptr == d.device_ctypes_pointer.value:
            return d
        for io in self._batch_ios.values():
            base, n = io["logits"].device_ctypes_pointer.value, io["logits"].shape[0]
            row = 4 * self.cfg.vocab_size
            if base <= ptr < base + n * row and (ptr - base) % row == 0:
                return io["logits"]
        return None

    def _sample_decode_row(self, lg, params, seed64, step):
        """The device sampler over a backend-owned logits row (`_graph_row`), replayed from a graph captured per
        parameter set and row (seed and step read from host-mapped memory): one graph launch instead of the sampler's
        eager launches and two uploads. The same kernels as the eager path, so the same token."""
        key = (float(params.temperature), int(params.top_k), float(params.top_p), float(params.min_p),
               lg.device_ctypes_pointer.value)
        self.m_seed.host[0] = seed64                       # nothing reads them now: the last token was read back
        self.m_step.host[0] = step
        seeds, steps = self.m_seed.dev, self.m_step.dev
        graph = self._sample_graphs.get(key)
        if graph is None and key not in self._sample_graphs:
            graph, ran, token = self._capture_or_run(lambda: self._sample_launch(lg, params, seeds, steps),
                                                     "the sampler")
            if graph is not None:                          # its token buffer: the scratch may be renewed later
                graph.keep = [list(self.scr.values()), self.m_seed, self.m_step, self._graph_row(lg)]
                graph.token = self._buf("token", (1,), np.int64)
            if len(self._sample_graphs) >= _SAMPLE_GRAPHS:   # many parameter sets and rows seen: start afresh
                for g in self._sample_graphs.values():
                    self._close_graph(g)
                self._sample_graphs.clear()
            self._sample_graphs[key] = graph
            if ran:                                        # the eager run's token (capturing runs nothing)
                return token
        if graph is None:
            return self._sample_launch(lg, params, seeds, steps)
        graph.launch()
        self.stats["sample_graph_replays"] += 1
        return graph.token

    def memory_plan(self):
        from ds4lib.engine.engine import MemoryPlan
        cfg, ctx = self.cfg, self.ctx.context_length
        W, dh = cfg.window_size, cfg.head_dim
        state = 0
        for r in self.roles[:cfg.n_layers]:
            state += (W + self.max_chunk) * dh * 2 + W * 8
            if r.owns_compressor:
                rows = -(-ctx // r.ratio)
                state += 2 * rows * dh * 2                          # BF16 rows, doubling: up to 2x the rows in use
                if r.ratio > 1:
                    state += 2 * r.ratio * dh * 4
                if r.indexer_owns_k:
                    state += 2 * rows * cfg.index_head_dim * 2
        state += 16 * max(cfg.engram_max_ngram_size, 1)
        if self.draft is not None:                                   # stage rings, rollback snapshot
            B = cfg.dspark_block_size
            state += (cfg.n_all_layers - cfg.n_layers) * ((W + B) * dh * 2 + W * 8)
            state += cfg.n_layers * min(W, B + 1) * (dh * 2 + 8)
        rope_bytes = 2 * 2 * (1 << max(0, ctx - 1).bit_length()) * (cfg.rope_head_dim // 2) * 4
        scratch = self._chunk_scratch(self.max_chunk) + rope_bytes
        return MemoryPlan(weights=self.weight_bytes, state=state, scratch=scratch, pool=2 * state)
