"""The five numbers of the bare ① base and of the base with a sidecar, on the same slices, same engine build,
one run (the notebook's before/after table): ds4lib.eval's one comparator, teacher logits cached."""
from __future__ import annotations

from pathlib import Path

__all__ = ["compare_stacks"]


def compare_stacks(*, base, sidecar, slices, checkpoint=None, windows: int | None = None, backend: str = "cpu",
                   cache_dir=None, tokenizer=None) -> list:
    """Rows {slice, stack ('base' | 'base+sidecar'), n, same_top1, sigma_min_*, kl_mean, ppl_*}. A slice is a
    committed slice name (finance/judge) or a .npy file of token windows [W, T]."""
    from ds4lib.config import Env
    from ds4lib.engine import Engine
    import numpy as np
    from ds4lib.eval import Teacher, evaluate_slice, evaluate_windows
    stacks = {"base": None, "base+sidecar": sidecar}
    rows, teacher = [], None
    for label, zchain in stacks.items():
        eng = Engine(base, zchain=zchain, engram_dir=checkpoint, backend=backend, tokenizer_path=tokenizer)
        if teacher is None:
            teacher = Teacher(Path(checkpoint or eng.engram_dir), Path(cache_dir or Env.read().cache_dir) / "teacher")
        for name in slices:
            if str(name).endswith(".npy"):
                comp, _ = evaluate_windows(eng, teacher, np.load(name)[:windows])
            else:
                comp, _ = evaluate_slice(eng, teacher, name, windows=windows)
            rows.append({"slice": name, "stack": label, **comp.as_dict()})
    return rows
