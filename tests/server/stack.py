"""A small random ds4 stack for tests of the server and the explore notebook.

A seeded random checkpoint of the tiny config with the ds4-tiny tokenizer's vocabulary (8,192 ids, so
data/tokenizer/tokenizer.json fits), 4 experts of width 64 and one Lloyd round: about 10 s to build on 2 cores.
The checkpoint directory doubles as the original model (teacher) and as the Engram table directory.
"""
from __future__ import annotations

import shutil
from pathlib import Path

__all__ = ["build_tiny_stack", "TOKENIZER"]

TOKENIZER = Path(__file__).resolve().parents[2] / "data" / "tokenizer" / "tokenizer.json"


def build_tiny_stack(out: Path, seed: int = 3) -> tuple[Path, Path]:
    """(base GGUF, checkpoint dir holding the Engram tables and tokenizer.json) under `out`."""
    from ds4lib.config import ModelConfig
    from ds4lib.quant import quantize_checkpoint
    from ds4lib.synth import write_random_checkpoint

    cfg = ModelConfig.tiny().replace(vocab_size=8192, n_routed_experts=4, n_activated_experts=2, moe_inter_dim=64,
                                     dspark_n_routed_experts=2, dspark_n_activated_experts=1)
    ck = Path(write_random_checkpoint(Path(out) / "ck", cfg, seed=seed))
    shutil.copy(TOKENIZER, ck / "tokenizer.json")
    base = Path(out) / "ds4-test.gguf"
    quantize_checkpoint(checkpoint=ck, out=base, rounds=1, progress=False)
    return base, ck
