"""The teacher fixture of a fitting slice: the original model's MoE block at every layer and token.

For each backbone layer l the original (ds4lib.ref on the official checkpoint, the same teacher as the five
numbers) gives, per token: the block's MoE input x (the full-precision router input, for recomputing the
original's routing), its MoE output y_orig (what the sidecar's gains aim at) and the experts it chose.
The forward runs layer-major: every window's call advances through layer l before any reaches l + 1, so one
layer's weights are in memory at a time, and each layer is written to disk (temporary name, then rename) as
soon as it is complete. The directory is keyed by the checkpoint's content hash and the token windows' hash,
and reused by later runs on the same text; an interrupted build keeps the layers already written.

    <cache>/sidecar_fixture/<model16>_<tokens16>/L03.npz   x [N, D] f32, y [N, D] f32, ids [N, K] i64
                                                   meta.json  {"model", "tokens", "windows", "seq_len", "layers"}

Shapes: W windows, T tokens per window, N = W·T rows, D hidden, K active experts.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ds4lib.ref import ReferenceModel

__all__ = ["TeacherFixture", "build_fixture", "fixture_sequences", "BOS"]

BOS = 0


def fixture_sequences(windows) -> np.ndarray:
    """Slice windows [W, T] (no BOS) -> the sequences the solver runs [W, T]: BOS + the window's first T − 1
    tokens, exactly what the five-number scorer feeds for the same window."""
    w = np.asarray(windows, dtype=np.int64)
    return np.concatenate([np.full((len(w), 1), BOS, np.int64), w[:, :-1]], axis=1)


@dataclass
class TeacherFixture:
    root: Path
    n_layers: int
    seqs: np.ndarray              # [W, T]

    def layer(self, l: int) -> dict:
        """{"x": [N, D], "y": [N, D], "ids": [N, K]} of backbone layer l."""
        with np.load(self.root / f"L{l:02d}.npz") as z:
            return {k: z[k] for k in z.files}


def _key(checkpoint_hash: str, seqs) -> str:
    return f"{checkpoint_hash[:16]}_{hashlib.sha256(np.ascontiguousarray(seqs).tobytes()).hexdigest()[:16]}"


def build_fixture(checkpoint, windows, cache_dir, *, progress=None, n_layers: int | None = None) -> TeacherFixture:
    """Build (or reuse) the fixture of token windows [W, T] for the checkpoint. `progress(l)` is called after each
    layer is on disk. `n_layers` builds only the first n layers (what a partial solve reads: layer l's rows depend
    only on layers <= l, so they are the same bytes as a whole build's); meta.json is written by a whole build only,
    and a later build of more layers runs the teacher from layer 0 again."""
    model = ReferenceModel.load(checkpoint)
    seqs = fixture_sequences(windows)
    model_hash = model.reader.content_hash()
    root = Path(cache_dir) / "sidecar_fixture" / _key(model_hash, seqs)
    L = model.cfg.n_layers
    last = L if n_layers is None else min(L, int(n_layers))
    fix = TeacherFixture(root, L, seqs)
    if all((root / f"L{l:02d}.npz").exists() for l in range(last)):
        return fix
    root.mkdir(parents=True, exist_ok=True)
    calls = [model.begin(s, model.new_state()) for s in seqs]
    for l in range(last):
        got: dict = {"x": [], "y": [], "ids": []}

        def observe(layer, name, value, got=got):
            key = {"moe_in": "x", "moe_out": "y", "router_ids": "ids"}.get(name)
            if key and layer == l:
                got[key].append(np.array(value))
        for c in calls:
            model.run_layer(c, l, observe)
        f = root / f"L{l:02d}.npz"
        if not f.exists():
            tmp = root / f"L{l:02d}.partial.npz"
            np.savez(tmp, x=np.concatenate(got["x"]).astype(np.float32), y=np.concatenate(got["y"]).astype(np.float32),
                     ids=np.concatenate(got["ids"]).astype(np.int64))
            os.replace(tmp, f)
        if progress:
            progress(l)
    if last < L:
        return fix
    meta = {"model": model_hash, "tokens": root.name.split("_")[1], "windows": len(seqs),
            "seq_len": int(seqs.shape[1]), "layers": L}
    (root / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
    return fix
