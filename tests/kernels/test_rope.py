"""kernels/rope.py against ds4lib.ref.rope.apply_rope (bit-exact)."""
import numpy as np
import pytest

from ds4lib.config import ModelConfig
from ds4lib.formats.floats import round_bf16
from ds4lib.ref.rope import apply_rope, rope_freqs
from tests.kernels.tolerances import assert_matches


def _tables(freqs, n_pos):
    """cos/sin per position, formed exactly as apply_rope forms them."""
    ang = np.outer(np.arange(n_pos, dtype=np.float32), freqs).astype(np.float32)
    return np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)


@pytest.mark.parametrize("yarn", [False, True])
def test_rope_matches_ref(cuda_ready, yarn):
    from kernels.rope import rope
    cfg = ModelConfig.tiny()
    freqs = rope_freqs(cfg.rope_head_dim, cfg.compress_rope_theta if yarn else cfg.rope_theta, yarn,
                       cfg.original_seq_len, cfg.rope_factor, cfg.beta_fast, cfg.beta_slow)
    rng = np.random.default_rng(int(yarn))
    n_pos = 70_000                                              # beyond the YaRN original length
    cos, sin = _tables(freqs, n_pos)
    d_cos, d_sin = cuda_ready.to_device(cos), cuda_ready.to_device(sin)
    # decode: one query [1, H, Dh] at a long-context position, in place, forward and inverse
    q = round_bf16(rng.standard_normal((1, 3, cfg.head_dim)) * 2)
    pos = np.array([n_pos - 1], dtype=np.int64)
    for inverse in (False, True):
        d_q = cuda_ready.to_device(q)
        rope(d_q, cuda_ready.to_device(pos), d_cos, d_sin, inverse=inverse)
        assert_matches("rope", d_q.copy_to_host(), apply_rope(q, pos, freqs, inverse=inverse))
    # prefill: 2-D kv rows [T, Dh] at ragged positions, out of place (head dims copied)
    kv = round_bf16(rng.standard_normal((5, cfg.head_dim)))
    pos = np.array([0, 1, 2, 4095, 65537], dtype=np.int64)
    d_kv = cuda_ready.to_device(kv)
    got = rope(d_kv, cuda_ready.to_device(pos), d_cos, d_sin,
               out=cuda_ready.device_array(kv.shape, dtype=np.float32)).copy_to_host()
    assert_matches("rope", got, apply_rope(kv, pos, freqs))
    np.testing.assert_array_equal(d_kv.copy_to_host(), kv)     # input untouched


def test_rope_empty_and_bad_shapes(cuda_ready):
    from kernels.rope import rope
    cos = np.ones((4, 2), np.float32)
    x = np.zeros((0, 8), np.float32)
    assert rope(x, np.zeros(0, np.int64), cos, cos).shape == (0, 8)
    with pytest.raises(ValueError):
        rope(np.zeros((1, 3), np.float32), np.zeros(1, np.int64), cos, cos)
