"""The mHC Sinkhorn normalisation of the trainer as one fused operation with its own backward (GPU, Triton).

    c = softmax(logits) + eps
    c = c / (colsum(c) + eps)                      # then iters - 1 times:
    c = c / (rowsum(c) + eps);  c = c / (colsum(c) + eps)

`sinkhorn(logits, iters, eps)` is that math on [..., S, S] (`ds4lib.ref.hc.sinkhorn`).
Unrolled in a compiled training graph, its 2*iters - 1 normalisations and their gradients were about 37 % of
the step's forward graph nodes (2,380 of 6,312 at ds4-tiny's 20 iterations and 10 mHC blocks) and most of the
cold compile time. On CUDA with Triton present the normalisations run as one custom operator (one kernel
forward, one backward), which the compiler treats as opaque; elsewhere the same math runs as the plain loop.

Backward of one normalisation y = x / (s + eps), s the sum of x along an axis:
    dx = (dy - sum_axis(dy * y)) / (s + eps)
The backward kernel recomputes the forward chain from the saved input instead of storing the 2*iters - 1
intermediates (a few thousand FLOPs per token, all in registers).

Imports torch (and Triton when present): training only.
"""
from __future__ import annotations

import os

import torch

try:                                              # the GPU machine has Triton; CPU-only installs need not
    import triton
    import triton.language as tl
except ImportError:                               # pragma: no cover - depends on the install
    triton = None


def sinkhorn_loop(c, iters: int, eps: float):
    """The plain math (any device, autograd through every step)."""
    c = torch.softmax(c, -1) + eps
    c = c / (c.sum(-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        c = c / (c.sum(-1, keepdim=True) + eps)
        c = c / (c.sum(-2, keepdim=True) + eps)
    return c


if triton is not None:
    @triton.jit
    def _norm(x, is_row, eps, S: tl.constexpr):
        """x [BM, S, S] normalised over each row (sum over the last axis) when `is_row`, else over each column;
        returns (y, 1/(s+eps) broadcast to [BM, S, S]). Both sums are formed and one chosen: `is_row` is a
        run-time value and both branches must have one shape."""
        inv_r = tl.expand_dims(1.0 / (tl.sum(x, axis=2) + eps), 2)      # [BM, S, 1]
        inv_c = tl.expand_dims(1.0 / (tl.sum(x, axis=1) + eps), 1)      # [BM, 1, S]
        inv = tl.where(is_row, inv_r + 0.0 * inv_c, inv_c + 0.0 * inv_r)
        return x * inv, inv

    @triton.jit
    def _sinkhorn_fwd(x_ptr, y_ptr, M, eps, n_ops: tl.constexpr, S: tl.constexpr, BM: tl.constexpr):
        pid = tl.program_id(0)
        rows = pid * BM + tl.arange(0, BM)
        idx = rows[:, None] * (S * S) + tl.arange(0, S * S)[None, :]
        ok = rows[:, None] < M
        x = tl.reshape(tl.load(x_ptr + idx, mask=ok, other=1.0), (BM, S, S))
        y, _ = _norm(x, False, eps, S)                              # op 0: columns
        for k in range(1, n_ops):                                   # odd ops rows, even ops columns
            y, _ = _norm(y, k % 2 == 1, eps, S)
        tl.store(y_ptr + idx, tl.reshape(y, (BM, S * S)), mask=ok)

    @triton.jit
    def _sinkhorn_bwd(x_ptr, g_ptr, dx_ptr, M, eps, n_ops: tl.constexpr, S: tl.constexpr, BM: tl.constexpr):
        pid = tl.program_id(0)
        rows = pid * BM + tl.arange(0, BM)
        idx = rows[:, None] * (S * S) + tl.arange(0, S * S)[None, :]
        ok = rows[:, None] < M
        x = tl.reshape(tl.load(x_ptr + idx, mask=ok, other=1.0), (BM, S, S))
        g = tl.reshape(tl.load(g_ptr + idx, mask=ok, other=0.0), (BM, S, S))
        for k in tl.static_range(n_ops - 1, -1, -1):                # the op whose output gradient g holds
            z = x                                                   # recompute its input: ops 0 .. k-1
            for j in range(0, k):
                z, _ = _norm(z, j % 2 == 1, eps, S)
            row = k % 2 == 1
            y, inv = _norm(z, row, eps, S)
            gy = g * y
            dot_r = tl.expand_dims(tl.sum(gy, axis=2), 2)
            dot_c = tl.expand_dims(tl.sum(gy, axis=1), 1)
            dot = tl.where(row, dot_r + 0.0 * dot_c, dot_c + 0.0 * dot_r)
            g = (g - dot) * inv
        tl.store(dx_ptr + idx, tl.reshape(g, (BM, S * S)), mask=ok)

    _BM = 64

    def _launch(kernel, *tensors, n_ops, eps, S):
        M = tensors[0].numel() // (S * S)
        out = torch.empty_like(tensors[0])
        kernel[(triton.cdiv(M, _BM),)](*tensors, out, M, eps, n_ops=n_ops, S=S, BM=_BM)
        return out

    @torch.library.custom_op("ds4train::sinkhorn_norm", mutates_args=())
    def sinkhorn_norm(x: torch.Tensor, n_ops: int, eps: float) -> torch.Tensor:
        """x [..., S, S] FP32 contiguous (softmax + eps already applied) -> the alternating normalisations."""
        return _launch(_sinkhorn_fwd, x.contiguous(), n_ops=n_ops, eps=eps, S=x.shape[-1])

    @sinkhorn_norm.register_fake
    def _(x, n_ops, eps):
        return torch.empty_like(x)

    @torch.library.custom_op("ds4train::sinkhorn_norm_bwd", mutates_args=())
    def sinkhorn_norm_bwd(x: torch.Tensor, g: torch.Tensor, n_ops: int, eps: float) -> torch.Tensor:
        return _launch(_sinkhorn_bwd, x.contiguous(), g.contiguous(), n_ops=n_ops, eps=eps, S=x.shape[-1])

    @sinkhorn_norm_bwd.register_fake
    def _(x, g, n_ops, eps):
        return torch.empty_like(x)

    def _setup(ctx, inputs, output):
        x, n_ops, eps = inputs
        ctx.save_for_backward(x)
        ctx.n_ops, ctx.eps = n_ops, eps

    def _backward(ctx, g):
        (x,) = ctx.saved_tensors
        return sinkhorn_norm_bwd(x, g, ctx.n_ops, ctx.eps), None, None

    sinkhorn_norm.register_autograd(_backward, setup_context=_setup)


_FUSED = {"enabled": os.environ.get("DS4_TRAIN_FUSED_SINKHORN", "1") != "0"}   # 0: always the loop


def fused_available(c) -> bool:
    S = c.shape[-1]
    return (triton is not None and _FUSED["enabled"] and c.is_cuda and c.dtype == torch.float32
            and S == c.shape[-2] and S & (S - 1) == 0)


def sinkhorn(c, iters: int, eps: float):
    """[..., S, S] logits -> the doubly normalised mixing matrix (fused on CUDA when Triton is present)."""
    if fused_available(c):
        return sinkhorn_norm(torch.softmax(c, -1) + eps, 2 * iters - 1, eps)
    return sinkhorn_loop(c, iters, eps)


def self_check(device="cuda", iters: int = 20, eps: float = 1e-6, rows: int = 4099) -> dict:
    """The fused operator against the loop, forward and gradient, on random logits; disables the fused path
    (and says so) when they disagree. Returns the relative errors."""
    if triton is None or not torch.cuda.is_available() and device == "cuda":
        return {"fused": False, "reason": "no Triton or no CUDA"}
    if not _FUSED["enabled"]:
        return {"fused": False, "reason": "DS4_TRAIN_FUSED_SINKHORN=0"}
    gen = torch.Generator(device="cpu").manual_seed(0)
    c = (torch.randn(rows, 4, 4, generator=gen) * 3).to(device)
    w = torch.randn(rows, 4, 4, generator=gen).to(device)
    a = c.clone().requires_grad_(True)
    b = c.clone().requires_grad_(True)
    ya = sinkhorn_loop(a, iters, eps)
    (ya * w).sum().backward()
    try:
        yb = sinkhorn_norm(torch.softmax(b, -1) + eps, 2 * iters - 1, eps)
        (yb * w).sum().backward()
    except Exception as e:                        # a kernel that does not build or run: the loop instead
        _FUSED["enabled"] = False
        return {"fused": False, "reason": f"{type(e).__name__}: {e}"[:500]}
    rel_y = float((ya - yb).detach().norm() / ya.detach().norm())
    rel_g = float((a.grad - b.grad).norm() / a.grad.norm())
    ok = rel_y < 1e-5 and rel_g < 1e-4
    _FUSED["enabled"] = ok
    return {"fused": ok, "rel_forward": rel_y, "rel_grad": rel_g}
