"""Token sampling: Gumbel-max over an exactly truncated distribution (the spec of kernels/sampling.py).

For one row of logits l [V] (float32) and parameters temperature, top_k, top_p, min_p, seed, step:

- temperature == 0: the argmax (lowest index among equal maxima); no randomness.
- z_i = (l_i - max l) / temperature in float64; W_i = floor(exp(z_i) * 2^32), an int64 fixed-point weight
  (the maximum has W = 2^32). Truncation uses only integer sums of W, so it does not depend on summation
  order, and a kernel reproduces it exactly.
- top_k (0 = off): keep l_i >= the k-th largest logit (tokens tied with it are all kept, as HF/vLLM do).
- top_p (1 = off), on the top-k distribution: P = float64(sum of W over the top-k kept tokens) * top_p; keep
  token i iff the weight of the tokens with a strictly larger logit is < P. This is the smallest prefix of
  the sorted distribution whose mass reaches top_p; tied tokens are kept or dropped together.
- min_p (0 = off): keep W_i >= min_p * 2^32, i.e. p_i >= min_p * p_max.
- token mask (optional; constrained decoding, ds4lib.engine.constrain): an int32 bitmask [ceil(V / 32)], bit i % 32
  of word i // 32 set = token i allowed (llguidance's layout). It applies before everything else: the row becomes
  l'_i = l_i where allowed, -inf elsewhere, and all of the above and below runs on l' (top-k counts the -inf tokens as
  any other value; their weight is 0, so they are never drawn while an allowed token has a finite logit). The
  non-finite check below sees the whole row l (a NaN outside the mask is still a broken forward) and l' (an allowed
  set whose logits are all -inf leaves nothing to draw). Without a mask the path is exactly the unmasked one.
- non-finite rows: a NaN or +inf logit, or no finite logit at all (every token -inf), means the forward went wrong;
  `sample` raises NonFiniteLogits instead of drawing a token (an argmax over NaN would silently give token 0 or
  the NaN's index). The device sampler reports such a row as token -1 and its host side raises the same error.
- sample: argmax over kept tokens of z_i + g_i with g_i = -log(-log(u_i)) (float64), u_i the uniform of the
  counter (i, step) under key `seed` from Philox-4x32-10: u = ((x0 >> 6) * 2^26 + (x1 >> 6) + 0.5) * 2^-52,
  which lies strictly inside (0, 1). Lowest index on exact ties. This draws token i with probability
  exp(z_i) / sum over kept of exp(z_j) (Gumbel-max), and the same (seed, step) gives the same token.

Shapes: V vocab, B rows.
"""
from __future__ import annotations

import numpy as np

__all__ = ["NonFiniteLogits", "check_finite", "PHILOX_KEY_BUMP", "philox4x32", "uniforms", "fixed_weights", "kept_mask",
           "probabilities", "sample", "sample_batch", "FIXED_ONE", "mask_words", "token_mask", "allowed_tokens",
           "masked_logits"]

class NonFiniteLogits(ValueError):
    """A logits row with NaN or +inf, or without any finite value: nothing can be sampled from it."""


def check_finite(logits) -> None:
    l = np.asarray(logits)
    top = l.max()                                   # NaN if any NaN
    if not np.isfinite(top):
        what = "NaN" if np.isnan(top) else "+inf" if top > 0 else "no finite value (every logit is -inf)"
        raise NonFiniteLogits(f"the logits hold {what}: the forward produced non-finite values, so no token is "
                              f"sampled")


def mask_words(n_vocab: int) -> int:
    """int32 words of a token bitmask over `n_vocab` tokens."""
    return (int(n_vocab) + 31) // 32


def token_mask(allowed) -> np.ndarray:
    """int32 [..., ceil(V / 32)] bitmask from bool [..., V] (the inverse of `allowed_tokens`)."""
    a = np.asarray(allowed, dtype=bool)
    pad = (-a.shape[-1]) % 32
    a = np.concatenate([a, np.zeros(a.shape[:-1] + (pad,), bool)], axis=-1)
    return np.ascontiguousarray(np.packbits(a, axis=-1, bitorder="little")).view(np.int32)


def allowed_tokens(mask, n_vocab: int) -> np.ndarray:
    """bool [V] from an int32 token bitmask [ceil(V / 32)] (module docstring)."""
    m = np.ascontiguousarray(mask, dtype=np.int32)
    if m.shape != (mask_words(n_vocab),):
        raise ValueError(f"a token mask over {n_vocab} tokens has {mask_words(n_vocab)} int32 words, got {m.shape}")
    return np.unpackbits(m.view(np.uint8), bitorder="little")[:n_vocab].astype(bool)


def masked_logits(logits, mask) -> np.ndarray:
    """float32 [V]: the logits of allowed tokens, -inf elsewhere."""
    l = np.asarray(logits, dtype=np.float32)
    return np.where(allowed_tokens(mask, l.shape[0]), l, np.float32(-np.inf))


FIXED_ONE = float(2 ** 32)                    # the weight of the most likely token
_M0, _M1 = np.uint64(0xD2511F53), np.uint64(0xCD9E8D57)
PHILOX_KEY_BUMP = (np.uint64(0x9E3779B9), np.uint64(0xBB67AE85))
_LO = np.uint64(0xFFFFFFFF)
_S32 = np.uint64(32)


def philox4x32(counter, key, rounds: int = 10):
    """Philox-4x32 (Salmon et al., Random123) on uint64 arrays holding 32-bit words: counter [..., 4],
    key [..., 2] -> [..., 4]. No product exceeds 64 bits, so nothing wraps."""
    c = [np.asarray(counter[..., i], dtype=np.uint64) & _LO for i in range(4)]
    k0 = np.asarray(key[..., 0], dtype=np.uint64) & _LO
    k1 = np.asarray(key[..., 1], dtype=np.uint64) & _LO
    for r in range(rounds):
        if r:
            k0 = (k0 + PHILOX_KEY_BUMP[0]) & _LO
            k1 = (k1 + PHILOX_KEY_BUMP[1]) & _LO
        p0 = _M0 * c[0]
        p1 = _M1 * c[2]
        c = [(p1 >> _S32) ^ c[1] ^ k0, p1 & _LO, (p0 >> _S32) ^ c[3] ^ k1, p0 & _LO]
    return np.stack(c, axis=-1)


def uniforms(seed: int, step: int, n: int) -> np.ndarray:
    """float64 [n] in (0, 1): the uniform of counter (i, step) under key seed, i = 0..n-1."""
    i = np.arange(n, dtype=np.uint64)
    s = np.uint64(step)
    ctr = np.stack([i & _LO, i >> _S32, np.full(n, s & _LO), np.full(n, s >> _S32)], axis=-1)
    sd = np.uint64(seed)
    x = philox4x32(ctr, np.array([sd & _LO, sd >> _S32], dtype=np.uint64))
    a = (x[:, 0] >> np.uint64(6)).astype(np.float64)
    b = (x[:, 1] >> np.uint64(6)).astype(np.float64)
    return (a * 2.0 ** 26 + b + 0.5) * 2.0 ** -52


def fixed_weights(logits, temperature: float):
    """(z float64 [V], W int64 [V]) for temperature > 0."""
    l = np.asarray(logits, dtype=np.float32).astype(np.float64)
    z = (l - l.max()) / float(temperature)
    return z, np.floor(np.exp(z) * FIXED_ONE).astype(np.int64)


def kept_mask(logits, *, temperature: float, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0):
    """bool [V]: the tokens the sampler may draw (temperature > 0)."""
    l = np.asarray(logits, dtype=np.float32)
    V = l.shape[0]
    _, W = fixed_weights(l, temperature)
    keep = np.ones(V, dtype=bool)
    if 0 < top_k < V:
        keep &= l >= np.sort(l)[::-1][top_k - 1]
    if top_p < 1.0:
        P = float(W[keep].sum()) * float(top_p)
        desc = np.sort(l)[::-1]                                       # C_gt(v) = weight of logits > v
        w_desc = np.sort(W)[::-1]                                     # W is monotone in l: same order
        excl = np.concatenate([[0], np.cumsum(w_desc)[:-1]])
        first = np.searchsorted(-desc, -l, side="left")               # first sorted slot holding l_i
        keep &= excl[first].astype(np.float64) < P
    if min_p > 0.0:
        keep &= W.astype(np.float64) >= float(min_p) * FIXED_ONE
    return keep


def probabilities(logits, *, temperature: float, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0):
    """float64 [V]: the distribution `sample` draws from (one-hot at the argmax for temperature 0)."""
    l = np.asarray(logits, dtype=np.float32)
    if temperature == 0:
        p = np.zeros(l.shape[0])
        p[int(np.argmax(l))] = 1.0
        return p
    z, _ = fixed_weights(l, temperature)
    keep = kept_mask(l, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    e = np.where(keep, np.exp(z), 0.0)
    return e / e.sum()


def sample(logits, *, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0,
           seed: int = 0, step: int = 0, mask=None) -> int:
    """One token from logits [V], among the tokens of `mask` (int32 bitmask, optional); NonFiniteLogits for a row
    with NaN or +inf, or with no finite value among the allowed tokens."""
    l = np.asarray(logits, dtype=np.float32)
    check_finite(l)
    if mask is not None:
        l = masked_logits(l, mask)
        if not np.isfinite(l.max()):
            raise NonFiniteLogits("no token the mask allows has a finite logit: nothing can be sampled")
    if temperature == 0:
        return int(np.argmax(l))
    z, _ = fixed_weights(l, temperature)
    keep = kept_mask(l, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    with np.errstate(divide="ignore"):
        g = -np.log(-np.log(uniforms(seed, step, l.shape[0])))
    return int(np.argmax(np.where(keep, z + g, -np.inf)))


def sample_batch(logits, seeds, steps, masks=None, **params) -> np.ndarray:
    """logits [B, V], seeds [B], steps [B], masks int32 [B, ceil(V / 32)] or None -> int64 [B], row by row."""
    rows = np.asarray(logits)
    ms = [None] * len(rows) if masks is None else list(np.asarray(masks))
    return np.array([sample(row, seed=int(s), step=int(t), mask=m, **params)
                     for row, s, t, m in zip(rows, seeds, steps, ms)], dtype=np.int64)
