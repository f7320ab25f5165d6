"""The parameters of notebooks/explore.ipynb, checked before it builds a widget or loads a model: a bad value stops
the run with a message naming the parameter (a widget would otherwise refuse it with its own error, or clamp a
number into its slider's range without a word).

Owns: `DOMAINS` (the notebook's domain choices: "none", the bare base, then the ② sidecar domains), `BOUNDS` (the
ranges of its sliders), `built_sidecars` and `check_explore_params`.
Does not own: the sidecar format (ds4lib.formats.sidecar; a directory listed here is still checked when the engine
mounts it), the sampling rules (ds4lib.engine.SamplingParams).
"""
from __future__ import annotations

import numbers
from pathlib import Path

__all__ = ["DOMAINS", "SIDECAR_DOMAINS", "BOUNDS", "built_sidecars", "check_explore_params"]

SIDECAR_DOMAINS = ("finance", "code", "law", "medicine", "science")     # the domain slices of ds4lib.corpus.split
DOMAINS = ("none",) + SIDECAR_DOMAINS
BOUNDS = {"temperature": (0.0, 2.0), "top_p": (0.05, 1.0), "top_k": (0, 200), "max_tokens": (1, 1024),
          "top_n": (1, 20)}                                              # the sliders' (min, max)
_INTEGERS = ("top_k", "max_tokens", "top_n")


def built_sidecars(root) -> dict:
    """domain -> its sidecar directory under `root` (root/<domain>/manifest.json present), for the domains built."""
    root = Path(root)
    return {d: root / d for d in SIDECAR_DOMAINS if (root / d / "manifest.json").is_file()}


def check_explore_params(*, base, checkpoint, domain, seed, **numeric) -> None:
    """Raise ValueError naming the first bad parameter: `base` not a file, `checkpoint` not a directory, `domain` not
    in DOMAINS, `seed` not an integer, or one of BOUNDS' parameters (given as keywords) outside its slider's range
    or of the wrong type."""
    if not Path(base).is_file():
        raise ValueError(f"base: {base!r} is not a file (the ① base GGUF)")
    if not Path(checkpoint).is_dir():
        raise ValueError(f"checkpoint: {checkpoint!r} is not a directory (the original model)")
    if domain not in DOMAINS:
        raise ValueError(f"domain: {domain!r} is not one of {', '.join(DOMAINS)}")
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
        raise ValueError(f"seed: {seed!r} is not an integer")
    for name, value in numeric.items():
        if name not in BOUNDS:
            raise TypeError(f"check_explore_params: no parameter {name!r}")
        lo, hi = BOUNDS[name]
        want = numbers.Integral if name in _INTEGERS else numbers.Real
        if isinstance(value, bool) or not isinstance(value, want):
            raise ValueError(f"{name}: {value!r} is not {'an integer' if name in _INTEGERS else 'a number'}")
        if not lo <= value <= hi:
            raise ValueError(f"{name}: {value!r} is outside [{lo}, {hi}]")
