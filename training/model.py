"""PyTorch training model of ds4-tiny: the same parameter names and math as ds4lib.ref (docs/architecture.md §4–§10).

Only the training run imports torch; the engine and toolchain never do. A full-sequence forward from
position 0 (the prefill case of the reference) with:
- quantisation-aware training: FP8/FP4 weights and FP8 activations fake-quantised with straight-through
  gradients, by the same rules the export and the reference use (`qat=True`);
- BF16 rounding at the official dtype boundaries (linear outputs, the HC state, norms);
- the indexer trained as DeepSeek does, by a KL term toward the main attention over compressed rows
  (its inputs detached, so it trains only itself);
- DSpark stages trained to draft the next block from detached target features (Markov bias with
  teacher-forced previous tokens; the confidence head learns whether each draft is right);
- auxiliary-loss-free router balancing: `ffn.gate.bias` moves by a sign rule on expert load.

Shapes: B batch, T tokens, S = 4 streams, D hidden, H heads, Dh head dim, G compressed rows, E experts.
"""
from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from ds4lib.engram_geometry import engram_geometry
from ds4lib.roles import layer_roles
from training.sinkhorn import sinkhorn

BF16 = torch.bfloat16


def rbf16(x):
    """Round to BF16 and back (gradient passes straight through the cast)."""
    return x.to(BF16).to(torch.float32)


def bf16_mm(op, *xs):
    """A product of BF16 inputs with FP32 accumulation and a BF16-valued FP32 result. On the GPU: BF16 tensor
    cores. On the CPU, where BF16 GEMMs are emulated and slow, the same values in FP32 (products of BF16 values
    are exact in FP32), rounded once to BF16: equal up to the accumulation order."""
    if xs[0].is_cuda:
        return op(*(x.to(BF16) for x in xs)).float()
    return rbf16(op(*(rbf16(x) for x in xs)))


def _pow2_ceil(x):
    return torch.exp2(torch.ceil(torch.log2(x)))


def _ste(x, q):
    return x + (q - x).detach()


def e4m3_round(x):
    return x.clamp(-448, 448).to(torch.float8_e4m3fn).to(torch.float32)


def e2m1_round(x):
    ax = x.abs().clamp(max=6.0)
    step = torch.where(ax < 2, 0.5, torch.where(ax < 4, 1.0, 2.0))
    return torch.copysign(torch.clamp(torch.round(ax / step) * step, max=6.0), x)


def act_quant_fp8(x, block=32):
    shp = x.shape
    xb = x.reshape(*shp[:-1], shp[-1] // block, block)
    amax = xb.detach().abs().amax(-1, keepdim=True).clamp_min(1e-4)
    s = _pow2_ceil(amax * (1.0 / 448.0))
    return _ste(x, (e4m3_round(xb / s) * s).reshape(shp))


def act_quant_fp4(x, block=32):
    shp = x.shape
    xb = x.reshape(*shp[:-1], shp[-1] // block, block)
    amax = xb.detach().abs().amax(-1, keepdim=True).clamp_min(6 * 2.0 ** -126)
    s = _pow2_ceil(amax * (1.0 / 6.0))
    return _ste(x, (e2m1_round(xb / s) * s).reshape(shp))


def act_quant_fp4_e4m3(x, block=16):
    shp = x.shape
    xb = x.reshape(*shp[:-1], shp[-1] // block, block)
    s = e4m3_round(xb.detach().abs().amax(-1, keepdim=True).clamp_min(6 * 2.0 ** -9) / 6.0)
    return _ste(x, (e2m1_round((xb / s).clamp(-6, 6)) * s).reshape(shp))


def fq_weight_fp8(w, block=32):
    o, i = w.shape
    po, pi = -o % block, -i % block
    wp = F.pad(w.detach(), (0, pi, 0, po))
    blocks = wp.reshape((o + po) // block, block, (i + pi) // block, block).abs().amax(dim=(1, 3))
    s = _pow2_ceil(blocks.clamp_min(1e-30) / 448.0)
    s = s.repeat_interleave(block, 0)[:o].repeat_interleave(block, 1)[:, :i]
    return _ste(w, e4m3_round(w / s) * s)


def fq_weight_fp4(w):
    o, i = w.shape
    g = w.reshape(o, i // 32, 32)
    s = _pow2_ceil(g.detach().abs().amax(-1, keepdim=True).clamp_min(1e-30) / 6.0)
    return _ste(w, (e2m1_round(g / s) * s).reshape(o, i))


class Linear(nn.Module):
    """kind: 'fp8' / 'fp4' (quantised weight, FP8 activation, BF16 output), 'bf16' (BF16 output), 'f32'."""

    def __init__(self, inp, out, kind, qat=True, std=None):
        super().__init__()
        self.kind, self.qat = kind, qat
        self.weight = nn.Parameter(torch.randn(out, inp) * (std if std is not None else inp ** -0.5))

    def eff_weight(self):
        if self.qat and self.kind == "fp8":
            return fq_weight_fp8(self.weight)
        if self.qat and self.kind == "fp4":
            return fq_weight_fp4(self.weight)
        return self.weight

    def forward(self, x):
        w = self.eff_weight()
        if self.kind == "f32":
            return x @ w.t()
        if self.kind in ("fp8", "fp4") and self.qat:
            x = act_quant_fp8(x)
        return bf16_mm(torch.matmul, x, w.t())             # BF16 inputs, FP32 accumulate, BF16 output values


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return rbf16(self.weight * (x * torch.rsqrt(x.square().mean(-1, keepdim=True) + self.eps)))


def rope_table(cfg, yarn, n_pos):
    from ds4lib.ref.rope import rope_freqs
    f = rope_freqs(cfg.rope_head_dim, cfg.compress_rope_theta if yarn else cfg.rope_theta, yarn,
                   cfg.original_seq_len, cfg.rope_factor, cfg.beta_fast, cfg.beta_slow)
    ang = np.outer(np.arange(n_pos, dtype=np.float32), f).astype(np.float32)
    return torch.from_numpy(np.cos(ang)), torch.from_numpy(np.sin(ang))


def apply_rope(x, cos, sin, inverse=False):
    """x [..., T, (H,) Dh] rotated on the last 2*len(f) dims; cos/sin [T, rd/2] broadcast over heads."""
    rd = 2 * cos.shape[-1]
    if x.dim() == cos.dim() + 2:          # [B, T, H, Dh]
        cos, sin = cos[:, None, :], sin[:, None, :]
    if inverse:
        sin = -sin
    head, tail = x[..., :-rd], x[..., -rd:]
    a, b = tail[..., 0::2], tail[..., 1::2]
    ra, rb = a * cos - b * sin, a * sin + b * cos
    return rbf16(torch.cat([head, torch.stack([ra, rb], -1).flatten(-2)], -1))


class Expert(nn.Module):
    def __init__(self, dim, inter, kind, qat, out_std):
        super().__init__()
        self.w1 = Linear(dim, inter, kind, qat)
        self.w2 = Linear(inter, dim, kind, qat, std=out_std)
        self.w3 = Linear(dim, inter, kind, qat)


def expert_forward(e, x, limit, weights=None):
    g, u = e.w1(x), e.w3(x)
    if limit > 0:
        u = u.clamp(-limit, limit)
        g = g.clamp(max=limit)
    a = F.silu(g) * u
    if weights is not None:
        a = a * weights[:, None]
    return e.w2(rbf16(a))


class Gate(nn.Module):
    def __init__(self, dim, n):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n, dim) * dim ** -0.5)
        self.register_buffer("bias", torch.zeros(n))


class MoE(nn.Module):
    def __init__(self, cfg, n_exp, top_k, qat, out_std):
        super().__init__()
        self.top_k, self.cfg, self.qat = top_k, cfg, qat
        self.gate = Gate(cfg.dim, n_exp)
        self.experts = nn.ModuleList(Expert(cfg.dim, cfg.moe_inter_dim, "fp4", qat, out_std) for _ in range(n_exp))
        self.shared_experts = Expert(cfg.dim, cfg.moe_inter_dim, "fp8", qat, out_std)

    def forward(self, x):
        """x [..., D] -> (y [..., D], expert load [E]).

        Routed experts in the dense form: every token meets every expert through three GEMMs over the
        stacked expert weights, with routing weight 0 for the experts it did not choose. A zero routing
        weight zeroes that expert's activation before the FP8 quantiser and the down projection, so the
        output and every gradient equal the routed computation's (a token's unchosen experts add exact
        zeros and receive zero gradient); only the FP32 summation order of the chosen experts may differ.
        At ds4-tiny's shapes (E 48, K 6, F 192, D 256) this costs 8x the routed FLOPs, which is still a
        small share of the H200's tensor throughput, and it keeps every shape static: no sort, no
        gather/scatter by expert, no capacity read back to the host, so the whole step compiles to one
        graph without host synchronisation."""
        cfg = self.cfg
        shp = x.shape
        x = x.reshape(-1, shp[-1])                                                        # [N, D]
        N, E, K = x.shape[0], len(self.experts), self.top_k
        s = torch.sqrt(F.softplus(x.float() @ self.gate.weight.float().t() / cfg.gate_temp))   # [N, E]
        ids = torch.topk(s + self.gate.bias, K, dim=-1).indices                          # [N, K]
        w = s.gather(1, ids)
        w = w / (w.sum(-1, keepdim=True) + 1e-20) * cfg.route_scale
        wt = torch.zeros_like(s).scatter(1, ids, w)                                       # [N, E]
        load = torch.zeros(E, device=x.device).scatter_add(0, ids.flatten(), torch.ones(N * K, device=x.device))
        xq = act_quant_fp8(x) if self.qat else x
        w1, w2, w3 = (self._stacked(name) for name in ("w1", "w2", "w3"))                  # [E, F, D], [E, D, F]
        Fi = w1.shape[1]
        g = bf16_mm(torch.matmul, xq, w1.reshape(E * Fi, -1).t()).reshape(N, E, Fi)      # [N, E, F]
        u = bf16_mm(torch.matmul, xq, w3.reshape(E * Fi, -1).t()).reshape(N, E, Fi)
        if cfg.swiglu_limit > 0:
            u = u.clamp(-cfg.swiglu_limit, cfg.swiglu_limit)
            g = g.clamp(max=cfg.swiglu_limit)
        a = rbf16(F.silu(g) * u * wt[..., None])
        if self.qat:
            a = act_quant_fp8(a)
        ye = bf16_mm(torch.bmm, a.transpose(0, 1), w2.transpose(1, 2))                    # [E, N, D]
        y = ye.sum(0) + expert_forward(self.shared_experts, x, cfg.swiglu_limit)
        return rbf16(y).reshape(shp), load

    def _stacked(self, name):
        w = torch.stack([getattr(e, name).weight for e in self.experts])
        if self.qat:
            E, o, i = w.shape
            g = w.reshape(E, o, i // 32, 32)
            sc = _pow2_ceil(g.detach().abs().amax(-1, keepdim=True).clamp_min(1e-30) / 6.0)
            w = _ste(w, (e2m1_round(g / sc) * sc).reshape(E, o, i))
        return w

    @torch.no_grad()
    def balance(self, load, rate):
        """Auxiliary-loss-free balancing: raise the selection bias of under-loaded experts (load [E] of one
        step, as returned by forward; no host read)."""
        self.gate.bias += rate * torch.sign(load.mean() - load)


def stable_top(x, k):
    """Indices of the k largest along the last axis: descending, lower index first among ties (as the reference)."""
    return torch.sort(x, dim=-1, descending=True, stable=True).indices[..., :k]


class Compressor(nn.Module):
    def __init__(self, cfg, ratio):
        super().__init__()
        self.ratio = ratio
        self.wkv = Linear(cfg.dim, cfg.head_dim, "f32" if ratio > 1 else "bf16")
        if ratio > 1:
            self.wgate = Linear(cfg.dim, cfg.head_dim, "f32")
        self.norm = RMSNorm(cfg.head_dim, cfg.norm_eps)

    def forward(self, x):
        B, T, _ = x.shape
        if self.ratio == 1:
            return self.norm(self.wkv(x))
        r = self.ratio
        n = T // r * r
        kv = self.wkv(x[:, :n]).reshape(B, n // r, r, -1)
        sc = self.wgate(x[:, :n]).reshape(B, n // r, r, -1)
        return self.norm(rbf16((kv * torch.softmax(sc, 2)).sum(2)))


class Indexer(nn.Module):
    def __init__(self, cfg, owns_k, qat):
        super().__init__()
        self.wq_b = Linear(cfg.q_lora_rank, cfg.index_n_heads * cfg.index_head_dim, "fp8", qat)
        self.weights_proj = Linear(cfg.dim, cfg.index_n_heads, "bf16")
        if owns_k:
            self.wk = Linear(cfg.head_dim, cfg.index_head_dim, "bf16")
            self.k_norm = RMSNorm(cfg.index_head_dim, cfg.norm_eps)


class Attention(nn.Module):
    def __init__(self, cfg, role, qat):
        super().__init__()
        self.cfg, self.role, self.qat = cfg, role, qat
        D, H, Dh = cfg.dim, cfg.n_heads, cfg.head_dim
        self.wq_a = Linear(D, cfg.q_lora_rank, "fp8", qat)
        self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.norm_eps)
        self.wq_b = Linear(cfg.q_lora_rank, H * Dh, "fp8", qat)
        self.wkv = Linear(D, Dh, "fp8", qat)
        self.kv_norm = RMSNorm(Dh, cfg.norm_eps)
        self.attn_sink = nn.Parameter(torch.zeros(H))
        self.wo_a = Linear(H * Dh // cfg.o_groups, cfg.o_groups * cfg.o_lora_rank, "fp8", qat)
        self.wo_b = Linear(cfg.o_groups * cfg.o_lora_rank, D, "fp8", qat, std=(cfg.o_groups * cfg.o_lora_rank) ** -0.5
                           / math.sqrt(2 * cfg.n_layers))
        if role.owns_compressor:
            self.compressor = Compressor(cfg, role.ratio)
        if role.owns_indexer:
            self.indexer = Indexer(cfg, role.indexer_owns_k, qat)

    def kv(self, x, cos, sin):
        kv = apply_rope(self.kv_norm(self.wkv(x)), cos, sin)
        return act_quant_fp8(kv) if self.qat else kv

    def query(self, x, cos, sin):
        B, T, _ = x.shape
        qr = self.q_norm(self.wq_a(x))
        q = self.wq_b(qr).reshape(B, T, self.cfg.n_heads, self.cfg.head_dim)
        return qr, apply_rope(q, cos, sin)

    def output(self, o, cos, sin):
        B, T = o.shape[:2]
        cfg = self.cfg
        o = apply_rope(o, cos, sin, inverse=True).reshape(B, T, cfg.o_groups, -1)
        wo_a = self.wo_a.eff_weight().reshape(cfg.o_groups, cfg.o_lora_rank, -1)
        u = bf16_mm(lambda a, b: torch.einsum("btgd,grd->btgr", a, b), o, wo_a)
        return self.wo_b(u.reshape(B, T, -1))


def sink_attention(q, keys, mask, sink, scale):
    """q [B, T, H, Dh]; keys [B, N, Dh] (also values); mask [B or 1, T, N] -> [B, T, H, Dh].
    As the reference: FP32 scores (BF16-valued inputs, so TF32 products are exact), row max over valid rows,
    exp weights rounded to BF16 for the value product, FP32 denominator with the sink."""
    z = torch.einsum("bthd,bnd->bhtn", q, keys) * scale
    z = z.masked_fill(~mask[:, None], float("-inf"))
    m = z.amax(-1, keepdim=True).detach()
    m = torch.where(torch.isfinite(m), m, torch.full_like(m, -1e30))
    e = torch.exp(z - m)
    den = e.sum(-1, keepdim=True) + torch.exp(sink.view(1, -1, 1, 1) - m)
    o = torch.einsum("bhtn,bnd->bthd", rbf16(e), keys) / den.permute(0, 2, 1, 3)
    return rbf16(o)


class Engram(nn.Module):
    def __init__(self, cfg, rows, qat):
        super().__init__()
        ncol = (cfg.engram_max_ngram_size - 1) * cfg.engram_n_heads
        self.embed = nn.Module()
        self.embed.weight = nn.Parameter(torch.randn(rows, cfg.engram_head_dim))
        self.q_weight = nn.Parameter(torch.ones(cfg.hc_mult, cfg.dim))
        self.k_weight = nn.Parameter(torch.ones(cfg.hc_mult, cfg.dim))
        self.wkv = Linear(ncol * cfg.engram_head_dim, cfg.dim * (cfg.hc_mult + 1), "fp8", qat,
                          std=(ncol * cfg.engram_head_dim) ** -0.5 * 0.1)
        self.cfg, self.qat = cfg, qat

    def table_rows(self, hashes):
        t = self.embed.weight
        if self.qat:   # FP8 rows with one UE8M0 scale per 32 columns, as exported
            g = t.reshape(t.shape[0], -1, 32)
            s = _pow2_ceil(g.detach().abs().amax(-1, keepdim=True).clamp_min(1e-30) / 448.0)
            t = _ste(t, (e4m3_round(g / s) * s).reshape(t.shape))
        return F.embedding(hashes, t)

    def forward(self, h, hashes):
        B, T, S, D = h.shape
        E = rbf16(self.table_rows(hashes)).reshape(B, T, -1)
        kv = self.wkv(E)
        key, value = kv[..., :S * D].reshape(B, T, S, D), kv[..., S * D:]
        w = self.q_weight * self.k_weight
        eps = self.cfg.norm_eps
        rstd = torch.rsqrt(h.square().mean(-1) + eps) * torch.rsqrt(key.square().mean(-1) + eps)
        dot = (h * w * key).sum(-1) * rstd * D ** -0.5
        gate = torch.sigmoid(torch.copysign(dot.abs().clamp_min(1e-6).sqrt(), dot))
        return rbf16(h + gate[..., None] * value[:, :, None, :])


class Block(nn.Module):
    def __init__(self, cfg, role, qat, engram_rows=0):
        super().__init__()
        self.cfg, self.role = cfg, role
        mix, hcd = (2 + cfg.hc_mult) * cfg.hc_mult, cfg.hc_mult * cfg.dim
        for sub in ("attn", "ffn"):
            setattr(self, f"hc_{sub}_fn", nn.Parameter(torch.randn(mix, hcd) * 0.1 * hcd ** -0.5))
            setattr(self, f"hc_{sub}_base", nn.Parameter(torch.zeros(mix)))
            setattr(self, f"hc_{sub}_scale", nn.Parameter(torch.ones(3)))
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attn = Attention(cfg, role, qat)
        out_std = cfg.moe_inter_dim ** -0.5 / math.sqrt(2 * cfg.n_layers)
        self.ffn = MoE(cfg, role.n_experts, role.top_k, qat, out_std)
        if role.engram:
            self.engram = Engram(cfg, engram_rows, qat)

    def mixes(self, h, sub):
        cfg = self.cfg
        B, T, S, D = h.shape
        f = h.reshape(B, T, S * D)
        m = (f @ getattr(self, f"hc_{sub}_fn").t()) * torch.rsqrt(f.square().mean(-1, keepdim=True) + cfg.norm_eps)
        base, scale = getattr(self, f"hc_{sub}_base"), getattr(self, f"hc_{sub}_scale")
        pre = torch.sigmoid(m[..., :S] * scale[0] + base[:S]) + cfg.hc_eps
        post = 2 * torch.sigmoid(m[..., S:2 * S] * scale[1] + base[S:2 * S])
        c = m[..., 2 * S:].reshape(B, T, S, S) * scale[2] + base[2 * S:].reshape(S, S)
        return pre, post, sinkhorn(c, cfg.hc_sinkhorn_iters, cfg.hc_eps)

    @staticmethod
    def collapse(h, pre):
        return rbf16((pre[..., None] * h).sum(-2))

    @staticmethod
    def expand(y, h, post, comb):
        return rbf16(post[..., None] * y[..., None, :] + torch.einsum("btij,btid->btjd", comb, h))

    def forward(self, h, pre_in, attend, loads=None):
        """`loads` (a list) receives this block's expert load [E]."""
        a_pre, a_post, a_comb = self.mixes(h, "attn")
        h = self.expand(attend(self.attn_norm(self.collapse(h, pre_in))), h, a_post, a_comb)
        f_pre, f_post, f_comb = self.mixes(h, "ffn")
        y, load = self.ffn(self.ffn_norm(self.collapse(h, a_pre)))
        if loads is not None:
            loads.append(load)
        h = self.expand(y, h, f_post, f_comb)
        return h, f_pre


class Model(nn.Module):
    def __init__(self, cfg, qat=True, max_pos=4096):
        super().__init__()
        self.cfg, self.qat = cfg, qat
        self.roles = layer_roles(cfg)
        self.geometry = engram_geometry(cfg)
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim)
        nn.init.normal_(self.embed.weight, std=1.0)
        rows = dict(zip(cfg.engram_layer_ids, cfg.engram_num_embeddings))
        self.layers = nn.ModuleList(Block(cfg, r, qat, rows.get(r.layer, 0)) for r in self.roles[:cfg.n_layers])
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.head = nn.Module()
        self.head.weight = nn.Parameter(torch.randn(cfg.vocab_size, cfg.dim) * cfg.dim ** -0.5)
        self.mtp = nn.ModuleList(Block(cfg, r, qat) for r in self.roles[cfg.n_layers:])
        if cfg.n_mtp_layers:
            s0, sl = self.mtp[0], self.mtp[-1]
            nt = len(cfg.dspark_target_layer_ids)
            s0.main_proj = Linear(cfg.dim * nt, cfg.dim, "fp8", qat)
            s0.main_norm = RMSNorm(cfg.dim, cfg.norm_eps)
            sl.norm = RMSNorm(cfg.dim, cfg.norm_eps)
            sl.markov_head = nn.Module()
            sl.markov_head.embed = nn.Module()
            sl.markov_head.embed.weight = nn.Parameter(torch.randn(cfg.vocab_size, cfg.dspark_markov_rank))
            sl.markov_head.head = nn.Module()
            sl.markov_head.head.weight = nn.Parameter(torch.zeros(cfg.vocab_size, cfg.dspark_markov_rank))
            sl.confidence_head = nn.Module()
            sl.confidence_head.proj = Linear(cfg.dim + cfg.dspark_markov_rank, 1, "f32", std=0.0)
        cos0, sin0 = rope_table(cfg, False, max_pos)
        cos1, sin1 = rope_table(cfg, True, max_pos)
        self.register_buffer("cos0", cos0, persistent=False)
        self.register_buffer("sin0", sin0, persistent=False)
        self.register_buffer("cos1", cos1, persistent=False)
        self.register_buffer("sin1", sin1, persistent=False)
        primes, offsets, mults = self.geometry.arrays()
        self.register_buffer("e_primes", torch.from_numpy(primes), persistent=False)
        self.register_buffer("e_offsets", torch.from_numpy(offsets), persistent=False)
        self.register_buffer("e_mults", torch.from_numpy(mults), persistent=False)
        self.register_buffer("token_map", torch.zeros(cfg.vocab_size, dtype=torch.int64), persistent=False)
        self.pad_cid = 0

    def set_token_map(self, token_map):
        self.token_map.copy_(torch.as_tensor(np.asarray(token_map), dtype=torch.int64))
        self.pad_cid = int(token_map[self.cfg.engram_pad_id])

    # ------------------------------------------------------------------ Engram hashes
    def hashes(self, ids):
        """ids [B, T] (sequences starting at position 0) -> [B, T, Le, C] hash rows."""
        cid = self.token_map[ids]
        B, T = ids.shape
        n, nh = self.cfg.engram_max_ngram_size, self.cfg.engram_n_heads
        rolling = torch.zeros(B, T, len(self.geometry.layer_ids), dtype=torch.int64, device=ids.device)
        out = []
        for k in range(n):
            src = F.pad(cid, (k, 0), value=self.pad_cid)[:, :T] if k else cid
            rolling = rolling ^ (src[..., None] * self.e_mults[:, k])
            if k >= 1:
                cols = slice((k - 1) * nh, k * nh)
                out.append(rolling[..., None] % self.e_primes[:, cols] + self.e_offsets[:, cols])
        return torch.cat(out, -1)

    # ------------------------------------------------------------------ attention of one backbone layer
    def _attend(self, blk, x, shared, losses):
        cfg, role, attn = self.cfg, blk.role, blk.attn
        B, T, _ = x.shape
        yarn = bool(role.ratio)
        cos, sin = (self.cos1, self.sin1) if yarn else (self.cos0, self.sin0)
        cos, sin = cos[:T], sin[:T]
        qr, q = attn.query(x, cos, sin)
        kv = attn.kv(x, cos, sin)
        t = torch.arange(T, device=x.device)
        win = (t[None, :] <= t[:, None]) & (t[None, :] > t[:, None] - cfg.window_size)
        keys, mask = kv, win[None].expand(B, T, T)
        if role.ratio:
            r = role.ratio
            if role.owns_compressor:
                lat = attn.compressor(x)
                G = lat.shape[1]
                gpos = torch.arange(G, device=x.device) * r
                if role.indexer_owns_k:
                    ik = apply_rope(attn.indexer.k_norm(attn.indexer.wk(lat.detach())), cos[gpos], sin[gpos])
                    shared["idxk", role.layer] = act_quant_fp4(ik) if self.qat else ik
                ck = apply_rope(lat, cos[gpos], sin[gpos])
                shared["ckv", role.layer] = act_quant_fp4_e4m3(ck) if self.qat else ck
            ckv = shared["ckv", role.kv_src]
            G = ckv.shape[1]
            reach = (t + 1) // r
            reachable = torch.arange(G, device=x.device)[None, :] < reach[:, None]          # [T, G]
            if role.owns_indexer:
                ind = attn.indexer
                nI, dI = cfg.index_n_heads, cfg.index_head_dim
                qi = apply_rope(ind.wq_b(qr.detach()).reshape(B, T, nI, dI), cos, sin)
                qi = act_quant_fp4(qi) if self.qat else qi
                wts = rbf16(ind.weights_proj(x.detach()) * (dI ** -0.5 * nI ** -0.5))
                ik = shared["idxk", role.kv_src]
                # the official BF16 roundings of the index score (product, weighting, head sum)
                dots = rbf16(torch.einsum("bthd,bgd->bthg", qi, ik))
                score = rbf16(rbf16(torch.relu(dots) * wts[..., None]).sum(2))
                score = score.masked_fill(~reachable, float("-inf"))
                sel_score = score.detach()
                if role.publishes_candidates:
                    shared["cand"] = self._candidates(sel_score, reach)
                if role.consumes_candidates:
                    sel_score = sel_score.masked_fill(~shared["cand"], float("-inf"))
                k = min(cfg.index_topk, G)
                top = stable_top(sel_score, k)
                sel = torch.zeros(B, T, G, dtype=torch.bool, device=x.device).scatter_(-1, top, True) & reachable
                shared["sel", role.layer] = sel
                # indexer KL toward the main attention over reachable compressed rows (targets detached)
                with torch.no_grad():
                    za = bf16_mm(lambda a, b: torch.einsum("bthd,bgd->bhtg", a, b), q, ckv) * cfg.head_dim ** -0.5
                    pa = torch.softmax(za.masked_fill(~reachable, float("-inf")), -1).nan_to_num(0).sum(1)
                    pa = pa / pa.sum(-1, keepdim=True).clamp_min(1e-30)
                logq = torch.log_softmax(score, -1).masked_fill(~reachable, 0)
                has = reach > 0
                kl = (pa * (torch.log(pa.clamp_min(1e-30)) - logq)).sum(-1)                  # [B, T]
                # mean over the positions that reach a compressed row (a mask, not a gather: static shapes)
                losses.setdefault("indexer", []).append((kl * has).sum() / (has.sum() * B))
            keys = torch.cat([kv, ckv], 1)
            mask = torch.cat([mask, shared["sel", role.idx_src]], -1)
        o = sink_attention(q, keys, mask, attn.attn_sink, cfg.head_dim ** -0.5)
        return attn.output(o, cos, sin)

    def _candidates(self, score, reach):
        cfg = self.cfg
        B, T, G = score.shape
        bs = cfg.candidate_block_size
        nb = -(-G // bs)
        blk = F.pad(score, (0, nb * bs - G), value=float("-inf")).reshape(B, T, nb, bs).amax(-1)
        last = (reach - 1) // bs
        blk = blk.masked_fill(torch.arange(nb, device=score.device)[None, :] == last[:, None], float("inf"))
        top = stable_top(blk, min(cfg.candidate_topk_blocks, nb))
        keep = torch.zeros_like(blk, dtype=torch.bool).scatter_(-1, top, blk.gather(-1, top) > float("-inf"))
        return keep.repeat_interleave(bs, -1)[..., :G]

    # ------------------------------------------------------------------ full forward
    def forward(self, ids, dspark_anchors=None):
        """ids [B, T] from position 0 -> (logits [B, T, V], losses dict, features [B, T, nt*D]).
        `dspark_anchors` int64 [B, A]: positions p whose next block the DSpark stages draft (drawn by the
        caller, so a step is a pure function of its inputs); losses["load"] lists every MoE's expert load."""
        cfg = self.cfg
        B, T = ids.shape
        hashes = self.hashes(ids)
        h = rbf16(self.embed(ids))[:, :, None, :].expand(B, T, cfg.hc_mult, cfg.dim)
        pre = torch.zeros(B, T, cfg.hc_mult, device=ids.device)
        pre[..., 0] = 1
        shared, losses, feats = {}, {"load": []}, []
        for blk in self.layers:
            role = blk.role
            if role.engram:
                h = blk.engram(h, hashes[:, :, role.engram_index])
            if role.dspark_target:
                feats.append(rbf16(h.mean(2)))
            h, pre = blk(h, pre, lambda x, blk=blk: self._attend(blk, x, shared, losses), losses["load"])
        logits = self.norm(Block.collapse(h, pre)) @ self.head.weight.t()
        features = torch.cat(feats, -1) if feats else None
        if dspark_anchors is not None and cfg.n_mtp_layers:
            losses.update(self.dspark_loss(ids, features.detach(), dspark_anchors, losses["load"]))
        return logits, losses, features

    # ------------------------------------------------------------------ DSpark
    def dspark_loss(self, ids, features, anchors, loads=None):
        """anchors [B, A]: each drafts the block after position p + 1 from target features up to p."""
        cfg = self.cfg
        n_anchor = anchors.shape[1]
        B, T = ids.shape
        Bk = cfg.dspark_block_size
        dev = ids.device
        s0 = self.mtp[0]
        main_x = s0.main_norm(s0.main_proj(features))                                     # [B, T, D]
        cos, sin = self.cos0, self.sin0
        p = anchors                                              # target position of the anchor's predecessor
        blk_pos = p[..., None] + 1 + torch.arange(Bk, device=dev)                        # [B, A, Bk]
        anchor = ids.gather(1, p + 1)                                                    # token at p+1
        blk_ids = torch.full((B, n_anchor, Bk), cfg.dspark_noise_token_id, device=dev)
        blk_ids[..., 0] = anchor
        N = B * n_anchor
        x_emb = rbf16(F.embedding(blk_ids, self.embed.weight.detach())).reshape(N, Bk, cfg.dim)
        h = x_emb[:, :, None, :].expand(N, Bk, cfg.hc_mult, cfg.dim)
        pre = torch.zeros(N, Bk, cfg.hc_mult, device=dev)
        pre[..., 0] = 1
        tpos = torch.arange(T, device=dev)
        ctx_mask = (tpos[None, None, :] <= p[..., None]) & (tpos[None, None, :] > p[..., None] - cfg.window_size)
        ctx_mask = ctx_mask.reshape(N, 1, T).expand(N, Bk, T)
        full_mask = torch.cat([ctx_mask, torch.ones(N, Bk, Bk, dtype=torch.bool, device=dev)], -1)
        bpos = blk_pos.reshape(N, Bk)
        bcos, bsin = cos[bpos], sin[bpos]                                                # [N, Bk, rd/2]
        batch_of = torch.arange(B, device=dev).repeat_interleave(n_anchor)
        for stage in self.mtp:
            a = stage.attn
            ctx = a.kv(main_x, cos[:T], sin[:T])                                        # [B, T, Dh]

            def attend(x, a=a, ctx=ctx):
                qr = a.q_norm(a.wq_a(x))
                q = apply_rope_rows(a.wq_b(qr).reshape(N, Bk, cfg.n_heads, cfg.head_dim), bcos, bsin)
                kb = apply_rope_rows(a.kv_norm(a.wkv(x)), bcos, bsin)
                kb = act_quant_fp8(kb) if self.qat else kb
                keys = torch.cat([ctx[batch_of], kb], 1)
                o = sink_attention(q, keys, full_mask, a.attn_sink, cfg.head_dim ** -0.5)
                o = apply_rope_rows(o, bcos, bsin, inverse=True).reshape(N, Bk, cfg.o_groups, -1)
                wo_a = a.wo_a.eff_weight().reshape(cfg.o_groups, cfg.o_lora_rank, -1)
                u = bf16_mm(lambda a, b: torch.einsum("btgd,grd->btgr", a, b), o, wo_a)
                return a.wo_b(u.reshape(N, Bk, -1))
            h, pre = stage(h, pre, attend, loads)
        last = self.mtp[-1]
        y = Block.collapse(h, pre)                                                       # [N, Bk, D]
        base = last.norm(y) @ self.head.weight.detach().t()
        truth = torch.stack([ids.gather(1, (p + 2 + i).clamp(max=T - 1)) for i in range(Bk)], -1).reshape(N, Bk)
        prev = torch.cat([anchor.reshape(N, 1), truth[:, :-1]], 1)
        m = rbf16(F.embedding(prev, last.markov_head.embed.weight))
        z = base + m @ last.markov_head.head.weight.t()
        ce = F.cross_entropy(z.reshape(-1, z.shape[-1]), truth.reshape(-1))
        conf = last.confidence_head.proj(torch.cat([y, m], -1).float())[..., 0]
        hit = (z.argmax(-1) == truth).float()
        bce = F.binary_cross_entropy_with_logits(conf, hit)
        return {"dspark": ce, "dspark_conf": bce, "dspark_acc": hit.mean(0).detach()}


def apply_rope_rows(x, cos, sin, inverse=False):
    """Per-row positions: x [N, Bk, (H,) Dh], cos/sin [N, Bk, rd/2]."""
    if x.dim() == 4:
        cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    rd = 2 * cos.shape[-1]
    if inverse:
        sin = -sin
    head, tail = x[..., :-rd], x[..., -rd:]
    a, b = tail[..., 0::2], tail[..., 1::2]
    return rbf16(torch.cat([head, torch.stack([a * cos - b * sin, a * sin + b * cos], -1).flatten(-2)], -1))
