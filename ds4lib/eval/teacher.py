"""Teacher logits from the original model (ds4lib.ref on the official-format checkpoint), cached on disk per
(tokens, model hash) as float16 — the teacher runs once per text, however many stacks are judged."""
from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np

from ds4lib.ref import ReferenceModel

__all__ = ["Teacher"]


class Teacher:
    def __init__(self, checkpoint_dir, cache_dir):
        self.dir = Path(checkpoint_dir)
        self.model = ReferenceModel.load(self.dir)
        self.model_hash = self.model.reader.content_hash()
        self.cache = Path(cache_dir) / self.model_hash[:16]
        self.cache.mkdir(parents=True, exist_ok=True)

    def logits(self, tokens) -> np.ndarray:
        toks = np.asarray(tokens, dtype=np.int64)
        key = hashlib.sha256(toks.tobytes()).hexdigest()[:32]
        f = self.cache / f"{key}_{len(toks)}.npy"
        if f.exists():
            return np.load(f).astype(np.float32)
        lg = self.model.logits(toks)
        tmp = f.with_name(f"{f.stem}.{os.getpid()}.partial.npy")    # one per process: two reports may fill one cache
        np.save(tmp, lg.astype(np.float16))
        os.replace(tmp, f)
        return np.load(f).astype(np.float32)
