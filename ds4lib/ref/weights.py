"""Float32 views of a checkpoint's weights for the reference forward, streamed layer by layer.

Every weight is dequantised exactly from its stored format (FP4/FP8 with UE8M0 scales, BF16, F32).
A layer's weights are materialised on first use and kept while the total stays under `cache_bytes`;
beyond it the least recently used layer is dropped, so a model larger than memory streams one layer
at a time. Engram tables are never materialised: rows are gathered on demand.
"""
from __future__ import annotations

from collections import OrderedDict

import numpy as np

from ds4lib.formats.names import layer_prefix

__all__ = ["RefWeights", "LayerCache"]


class LayerCache:
    """Per-layer dictionaries of float32 arrays, materialised by `_load_layer(l)` on first use and kept while their
    total stays under `cache_bytes`; beyond it the least recently used layer is dropped."""

    def __init__(self, cache_bytes: int):
        self.cache_bytes = cache_bytes
        self._layers: "OrderedDict[int, dict]" = OrderedDict()
        self._bytes = 0

    def _load_layer(self, l: int) -> dict:
        raise NotImplementedError

    def layer(self, l: int) -> dict:
        """{relative name: float32 array} for layer l."""
        if l in self._layers:
            self._layers.move_to_end(l)
            return self._layers[l]
        out = self._load_layer(l)
        size = sum(a.nbytes for a in out.values())
        while self._layers and self._bytes + size > self.cache_bytes:
            _, old = self._layers.popitem(last=False)
            self._bytes -= sum(a.nbytes for a in old.values())
        self._layers[l] = out
        self._bytes += size
        return out


class RefWeights(LayerCache):
    def __init__(self, reader, cache_bytes: int = 4 << 30):
        super().__init__(cache_bytes)
        self.reader, self.cfg = reader, reader.cfg
        self._globals: dict = {}

    def global_(self, name):
        if name not in self._globals:
            self._globals[name] = self.reader.weight(name)
        return self._globals[name]

    def _load_layer(self, l: int) -> dict:
        """Every tensor of layer l except scales and the Engram table."""
        p = layer_prefix(self.cfg, l)
        return {name[len(p):]: self.reader.weight(name) for name in self.reader.layer_names(l)
                if not (name.endswith(".scale") or name.endswith("engram.embed.weight"))}

    def engram_rows(self, l: int, hashes) -> np.ndarray:
        """hashes [T, C] -> dequantised rows [T, C, hd]."""
        name = layer_prefix(self.cfg, l) + "engram.embed.weight"
        flat = np.asarray(hashes).reshape(-1)
        rows = self.reader.engram_rows(name, flat)
        return rows.reshape(np.shape(hashes) + (rows.shape[-1],))
