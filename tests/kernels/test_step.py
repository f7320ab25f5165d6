"""kernels/step.py: a decode step's device inputs, the compressed rows of a call, the benchmark fill."""
import numpy as np


def test_step_inputs_copy_position_token_and_dead_flag(cuda_ready):
    from kernels.step import step_inputs
    cuda = cuda_ready
    inp = cuda.mapped_array(2, np.int64)
    pos, rep, dead = cuda.device_array(1, np.int64), cuda.device_array(4, np.int64), cuda.device_array(1, np.uint8)
    for p, tok, image in ((0, 17, 63), (41, 63, 63), (2 ** 40, 5, 63)):
        inp[0], inp[1] = p, tok
        step_inputs(inp, image, pos, rep, dead)
        assert pos.copy_to_host()[0] == p
        np.testing.assert_array_equal(rep.copy_to_host(), [tok] * 4)
        assert dead.copy_to_host()[0] == (tok == image)


def test_batch_inputs_give_each_row_its_position_token_and_dead_flag(cuda_ready):
    from kernels.step import batch_inputs
    cuda = cuda_ready
    rows = np.array([[0, 17], [41, 63], [2 ** 40, 5]], dtype=np.int64)
    inp = cuda.mapped_array(rows.shape, np.int64)
    inp[:] = rows
    B, S = rows.shape[0], 4
    pos, rep, dead = (cuda.device_array(B, np.int64), cuda.device_array(B * S, np.int64),
                      cuda.device_array(B, np.uint8))
    batch_inputs(inp, 63, pos, rep, dead)
    np.testing.assert_array_equal(pos.copy_to_host(), rows[:, 0])
    np.testing.assert_array_equal(rep.copy_to_host(), np.repeat(rows[:, 1], S))
    np.testing.assert_array_equal(dead.copy_to_host(), [0, 1, 0])
    import pytest
    with pytest.raises(ValueError, match="batch_inputs"):
        batch_inputs(inp, 63, pos, cuda.device_array(B * S + 1, np.int64), dead)


def test_group_rows_follow_the_compressor_rule(cuda_ready):
    """rows[j] = group id of the j-th group a call completes, -1 past them; gpos = group id * ratio."""
    from kernels.step import group_rows
    cuda = cuda_ready
    for p0, T, ratio, n in ((0, 1, 2, 1), (1, 1, 2, 1), (6, 5, 2, 3), (7, 3, 1, 3), (9, 4, 4, 2), (130, 1, 128, 1)):
        rows, gpos = cuda.device_array(n, np.int64), cuda.device_array(n, np.int64)
        group_rows(cuda.to_device(np.arange(p0, p0 + T, dtype=np.int64)), ratio, rows, gpos)
        first, count = p0 // ratio, (p0 + T) // ratio - p0 // ratio
        want = [first + j if j < count else -1 for j in range(n)]
        np.testing.assert_array_equal(rows.copy_to_host(), want)
        np.testing.assert_array_equal(gpos.copy_to_host(), (first + np.arange(n)) * ratio)


def test_fill_bits_is_deterministic_finite_and_bounded(cuda_ready):
    from ds4lib.formats.floats import bf16_bits_to_f32
    from kernels.step import fill_bits
    cuda = cuda_ready
    a, b, c = (cuda.device_array((5, 24), np.uint16) for _ in range(3))
    fill_bits(a, 7, 2.0)
    fill_bits(b, 7, 2.0)
    fill_bits(c, 8, 2.0)
    va = bf16_bits_to_f32(a.copy_to_host())
    np.testing.assert_array_equal(a.copy_to_host(), b.copy_to_host())
    assert not np.array_equal(a.copy_to_host(), c.copy_to_host())
    assert np.isfinite(va).all() and np.abs(va).max() <= 1.0 and va.std() > 0.2
