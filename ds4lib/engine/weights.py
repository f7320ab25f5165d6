"""The weights the engine runs: the ① base (VQ experts, q4_K and the rest), the Engram tables from the
original checkpoint directory, and the ② sidecar / ③ post-training gains and router biases stacked on top.

`StackWeights` has the interface the reference forward reads (`layer(l)`, `global_(name)`,
`engram_rows(l, hashes)`), so the CPU backend is the reference math over the quantised values. A
routed expert's down projection gets g_eff = g_base * s_sidecar * s_posttrain on its output channels
(the rows of w2); the router's selection bias gets both Δb added (selection only, as the checkpoint's own
bias). Layers are dequantised on first use and kept within `cache_bytes` (LRU), so a model larger than
memory streams. Shapes: E experts, D hidden, F expert width.
"""
from __future__ import annotations

import numpy as np

from ds4lib.formats.names import layer_prefix
from ds4lib.formats.vq import EXPERT_MATRICES
from ds4lib.ref.weights import LayerCache

__all__ = ["StackWeights"]


class StackWeights(LayerCache):
    def __init__(self, base, engram_reader, gains=None, bias=None, cache_bytes: int = 4 << 30):
        super().__init__(cache_bytes)
        self.base, self.cfg = base, base.config
        self.engram_reader = engram_reader
        self.gains = gains or {}          # layer -> float32 [E, D] combined sidecar x post-training gains
        self.bias = bias or {}            # layer -> float32 [E] combined selection-bias deltas
        self._globals: dict = {}
        self._names = {}
        for name in base.layout:
            if name.endswith(".scale") or "vq_" in name or name.startswith("ds4."):
                continue
            self._names.setdefault(self._layer_of(name), []).append(name)

    def _layer_of(self, name):
        cfg = self.cfg
        if name.startswith("layers."):
            return int(name.split(".")[1])
        if name.startswith("mtp."):
            return cfg.n_layers + int(name.split(".")[1])
        return -1

    def global_(self, name):
        if name not in self._globals:
            self._globals[name] = self.base.tensor(name)
        return self._globals[name]

    def _load_layer(self, l: int) -> dict:
        p = layer_prefix(self.cfg, l)
        out = {name[len(p):]: self.base.tensor(name) for name in self._names.get(l, [])}
        g = self.gains.get(l)
        for e in range(self.cfg.moe_shape(l)[0]):
            for mat in EXPERT_MATRICES:
                w = self.base.dequant_expert(l, e, mat)
                if mat == "w2" and g is not None:
                    w = w * g[e][:, None]
                out[f"ffn.experts.{e}.{mat}.weight"] = w
        if l in self.bias:
            out["ffn.gate.bias"] = (out["ffn.gate.bias"] + self.bias[l]).astype(np.float32)
        return out

    def engram_rows(self, l: int, hashes) -> np.ndarray:
        name = layer_prefix(self.cfg, l) + "engram.embed.weight"
        flat = np.asarray(hashes).reshape(-1)
        rows = self.engram_reader.engram_rows(name, flat)
        return rows.reshape(np.shape(hashes) + (rows.shape[-1],))

    def dequantized_bytes(self) -> int:
        """Bytes the CPU backend holds once every layer is materialised (float32)."""
        cfg = self.cfg
        total = 0
        for name in self.base.layout:
            if name.startswith("ds4.") or name.endswith(".scale") or "vq_" in name:
                continue
            spec = self.base._inventory.get(name)
            if spec is not None:
                total += 4 * spec.numel
        for l in range(cfg.n_all_layers):
            E = cfg.moe_shape(l)[0]
            total += 4 * E * 3 * cfg.dim * cfg.moe_inter_dim
        return total
