"""kernels.mma: the E4M3 MMA issued as two chained f16 MMAs (mma_e4m3_f16_device) against the E4M3 instruction.

On the GPU the chain must give the instruction's values exactly: ptxas emulates the E4M3 MMA on sm_90 with the same
two HMMAs on the same halves (kernels.mma's docstring), and only the sign of a zero may differ (the emulation adds
C = 0 after the chain). In the simulator each MMA is the ideal one, so the instruction rounds its 32-term sum once
and the chain rounds after each half: both are checked against those models. Operands: q4_K-style (A the nibble
codes 0..15, E4M3 subnormals, B signed activations over the whole range) and codes of any finite value on both sides.
"""
import numpy as np
import pytest

from ds4lib.formats.fp8 import E4M3_VALUES

FINITE = np.array([c for c in range(256) if c & 0x7F != 0x7F], np.uint8)


def _registers(a, b):
    """A [W, 16, 32] and B [W, 32, 8] E4M3 codes -> each warp's fragment registers [W, 32 lanes, 6] (uint32)."""
    n = a.shape[0]
    regs = np.zeros((n, 32, 6), np.uint32)
    for lane in range(32):
        g, t = divmod(lane, 4)
        parts = (a[:, g, 4 * t:4 * t + 4], a[:, g + 8, 4 * t:4 * t + 4], a[:, g, 16 + 4 * t:20 + 4 * t],
                 a[:, g + 8, 16 + 4 * t:20 + 4 * t], b[:, 4 * t:4 * t + 4, g], b[:, 16 + 4 * t:20 + 4 * t, g])
        for j, p in enumerate(parts):
            regs[:, lane, j] = np.ascontiguousarray(p).view(np.uint32).reshape(n)
    return regs


def _outputs(d):
    """D [W, 16, 8] -> the lanes' four outputs [W, 32, 4] (d0 = (g, 2t), d1 = (g, 2t+1), d2 = (g+8, 2t), d3)."""
    out = np.zeros((d.shape[0], 32, 4), np.float32)
    for lane in range(32):
        g, t = divmod(lane, 4)
        out[:, lane] = np.stack([d[:, g, 2 * t], d[:, g, 2 * t + 1], d[:, g + 8, 2 * t], d[:, g + 8, 2 * t + 1]], 1)
    return out


def _operands(rng, n, q4k):
    a = rng.integers(0, 16, (n, 16, 32)).astype(np.uint8) if q4k else rng.choice(FINITE, (n, 16, 32))
    b = rng.choice(FINITE, (n, 32, 8))
    return a, b


@pytest.mark.parametrize("q4k", [True, False], ids=["nibble-codes", "any-codes"])
def test_chained_f16_mma_gives_the_e4m3_instruction(cuda_ready, q4k):
    from kernels.mma import mma_e4m3_pair_kernel
    from tests.kernels.conftest import SIMULATOR
    rng = np.random.default_rng(11 if q4k else 12)
    n = 6 if SIMULATOR else 400
    a, b = _operands(rng, n, q4k)
    b[0] = 0                                               # exact zeros (the sign may differ there)
    va, vb = E4M3_VALUES[a].astype(np.float64), E4M3_VALUES[b].astype(np.float64)
    out = cuda_ready.device_array((n, 2, 32, 4), np.float32)
    mma_e4m3_pair_kernel[-(-n // 4), 128](cuda_ready.to_device(_registers(a, b)), out)
    got = out.copy_to_host()
    exact = _outputs(np.einsum("wik,wkj->wij", va, vb))
    low = (np.arange(32) % 4) < 2                          # k of each register's two low codes: the first f16 MMA
    first = np.einsum("wik,wkj->wij", va[:, :, low], vb[:, low, :]).astype(np.float32).astype(np.float64)
    chain = _outputs(first + np.einsum("wik,wkj->wij", va[:, :, ~low], vb[:, ~low, :]))
    if SIMULATOR:
        np.testing.assert_array_equal(got[:, 0], exact)    # the ideal instruction: one rounding
        np.testing.assert_array_equal(got[:, 1], chain)    # the ideal chain: a rounding after each half
    else:
        np.testing.assert_array_equal(got[:, 1], got[:, 0])     # ptxas's emulation, value for value
    scale = np.abs(_outputs(np.einsum("wik,wkj->wij", np.abs(va), np.abs(vb)))) + 1e-30
    # both within FP32 accumulation error of the exact sums (the tensor cores' own adds may round differently from
    # the ideal model: 2^-19 of the sum of magnitudes leaves room for 32 of them; a wrong pairing of k would be O(1))
    assert np.max(np.abs(got - exact[:, None]) / scale[:, None]) < 2.0 ** -19
