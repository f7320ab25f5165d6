"""Capture of one MoE layer on the deployment path: the engine's own prefill (CPU or CUDA backend) with its
observer hooks, nothing recomputed in a second implementation.

Per token of layer l: router scores [E] (unbiased), chosen ids [K], routing weights [K], ye [K, D] (each
chosen expert's down-projection output per unit routing weight), the shared expert's output ysh [D] and the
engine's MoE output [D]. The forward stops right after layer l's MoE (the layers above cannot change it).
Every capture is checked: round_bf16(Σ_k rw·ye + ysh), summed as the engine sums (ascending expert id, then
the shared expert), must equal the engine's output bit for bit on ≥ 99.99% of values, or CaptureError.

Shapes: N rows (all windows' tokens), E experts, K active experts, D hidden.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ds4lib.formats.floats import round_bf16

__all__ = ["LayerCapture", "CaptureError", "capture_layer", "reconstruct", "weighted_outputs", "EXACT_MIN"]

EXACT_MIN = 0.9999
_NAMES = ("router_scores", "router_ids", "router_weights", "ye", "ysh", "moe_out")


class CaptureError(RuntimeError):
    """The capture does not reproduce the engine's block output; the solve must not continue."""


class _Stop(Exception):
    pass


@dataclass
class LayerCapture:
    layer: int
    scores: np.ndarray        # [N, E]
    ids: np.ndarray           # [N, K]
    weights: np.ndarray       # [N, K]
    ye: np.ndarray            # [N, K, D]
    ysh: np.ndarray           # [N, D]
    out: np.ndarray           # [N, D] the engine's MoE output
    exact: float              # share of values reconstructed bit for bit


def weighted_outputs(weights, ye) -> np.ndarray:
    """c = rw·ye [N, K, D]: each routed expert's summed term as the engine holds it. The routing weight enters
    before the down projection, whose output is a BF16 value; the hook reports it divided by rw (ye per unit
    weight), so rw·ye is that BF16 value up to one float32 rounding, and round_bf16 recovers it exactly."""
    return round_bf16(np.asarray(weights, np.float32)[:, :, None] * np.asarray(ye, np.float32))


def reconstruct(ids, weights, ye, ysh) -> np.ndarray:
    """round_bf16(Σ rw·ye + ysh) with the engine's order: float32 sum over slots by ascending expert id."""
    order = np.argsort(ids, axis=1, kind="stable")
    c = weighted_outputs(weights, ye)                                                       # [N, K, D]
    c = np.take_along_axis(c, order[:, :, None], axis=1)
    acc = np.zeros(c[:, 0].shape, np.float32)
    for k in range(c.shape[1]):
        acc = acc + c[:, k]
    return round_bf16(acc + np.asarray(ysh, np.float32))


def capture_layer(engine, seqs, layer: int, *, check: bool = True) -> LayerCapture:
    """Run every sequence [W, T] through engine.prefill (in one block) up to layer `layer`'s MoE."""
    got = {n: [] for n in _NAMES}
    rows = [0, 0]                  # rows of the current sequence seen so far, its length

    def observe(l, name, value):
        if l == layer and name in got:
            got[name].append(np.array(value))
            if name == "moe_out":
                rows[0] += len(value)
                if rows[0] >= rows[1]:  # a backend may split a call into chunks: stop after the last one
                    raise _Stop

    for s in seqs:
        sess = engine.new_session()
        rows[:] = [0, len(s)]
        try:
            engine.prefill(sess, s, observer=observe)
        except _Stop:
            pass
        if rows[0] != len(s):
            raise CaptureError(f"layer {layer}: the engine's forward reported {rows[0]} of {len(s)} rows of its "
                               f"MoE output")
    cat = {n: np.concatenate(v) for n, v in got.items()}
    cap = LayerCapture(layer, cat["router_scores"].astype(np.float32), cat["router_ids"].astype(np.int64),
                       cat["router_weights"].astype(np.float32), cat["ye"].astype(np.float32),
                       cat["ysh"].astype(np.float32), cat["moe_out"].astype(np.float32), 1.0)
    rec = reconstruct(cap.ids, cap.weights, cap.ye, cap.ysh)
    cap.exact = float((rec.view(np.uint32) == cap.out.view(np.uint32)).mean())
    if check and cap.exact < EXACT_MIN:
        raise CaptureError(f"layer {layer}: round_bf16(Σ rw·ye + ysh) equals the engine's MoE output on only "
                           f"{100 * cap.exact:.4f}% of values (need ≥ {100 * EXACT_MIN:.2f}%)")
    return cap
