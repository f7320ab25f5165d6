"""kernels/spec_accept.py against the host's speculative acceptance (ds4lib.engine.speculative.verify_rows and
residual_token): the same (kept count, next token) for greedy and sampled rounds, every kind of truncation, drafts
that are kept, rejected at each position, or all kept (the bonus token)."""
import numpy as np
import pytest

from ds4lib.engine import SamplingParams
from ds4lib.engine import speculative as spec
from ds4lib.ref import sampling as ref
from tests.kernels.compile_sm90 import ptx_counts

PARAMS = [dict(temperature=0.0),
          dict(temperature=1.0),
          dict(temperature=0.8, top_k=20, top_p=0.9, min_p=0.02),
          dict(temperature=1.2, top_p=0.7)]


def _host(target, draft, drafts, params, seed, first):
    """The host's verify_rows with the bonus drawn by the reference sampler, as the engine's CPU path runs it."""
    k = len(drafts)
    q_rows = [ref.probabilities(draft[j], temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
                                min_p=params.min_p) for j in range(k)]

    def bonus(row, position):
        return ref.sample(row, temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
                          min_p=params.min_p, seed=seed, step=(spec.BONUS << 56) | position)
    return spec.verify_rows(target, drafts, q_rows, params, seed, first, bonus)


@pytest.mark.parametrize("pi", range(len(PARAMS)))
def test_accept_matches_the_host(cuda_ready, pi):
    from kernels.spec_accept import accept
    cuda = cuda_ready
    params = SamplingParams(max_tokens=8, **PARAMS[pi])
    rng = np.random.default_rng(pi)
    V, B = 300, 4                                              # 3 blocks a row with chunk 128
    seen = set()
    for trial in range(10):
        k = int(rng.integers(0, B + 1))
        target = np.round(rng.standard_normal((k + 1, V)) * 2, 2).astype(np.float32)
        draft = (target[:max(k, 1)] + rng.standard_normal((max(k, 1), V)).astype(np.float32) * 0.7)[:B]
        draft = np.ascontiguousarray(np.concatenate([draft, np.zeros((B - len(draft), V), np.float32)]))
        seed, first = int(rng.integers(0, 2**62)), int(rng.integers(5, 10_000))
        drafts = np.zeros(B, np.int64)
        for j in range(k):                                     # drafts from q (mostly), sometimes a poor token
            drafts[j] = ref.sample(draft[j], temperature=max(params.temperature, 0.5), seed=seed + j, step=trial) \
                if trial % 3 else int(np.argmin(target[j]))
        if params.temperature == 0 and trial % 2:              # greedy: drafts right up to a point
            drafts[:k] = np.argmax(target[:k], axis=1)
            if k and trial % 4 == 1:
                drafts[k - 1] = (drafts[k - 1] + 1) % V
        want = _host(target, draft, [int(d) for d in drafts[:k]], params, seed, first)
        io = cuda.to_device(np.array([np.array([seed], np.uint64).view(np.int64)[0], first,
                                      (spec.BONUS << 56) | (first + k)], np.int64))
        out = accept(cuda.to_device(target), cuda.to_device(draft), cuda.to_device(drafts), k, io,
                     temperature=params.temperature, top_k=params.top_k, top_p=params.top_p, min_p=params.min_p,
                     chunk=128).copy_to_host()
        assert (int(out[0]), int(out[1])) == want, f"trial {trial}, k {k}"
        seen.add("all kept" if want[0] == k else "rejected")
    assert seen == {"all kept", "rejected"}


def test_accept_checks_shapes(cuda_ready):
    from kernels.spec_accept import accept
    cuda = cuda_ready
    t, d = cuda.device_array((3, 40), np.float32), cuda.device_array((4, 40), np.float32)
    io, drafts = cuda.device_array(3, np.int64), cuda.device_array(4, np.int64)
    with pytest.raises(ValueError, match="k \\+ 1"):
        accept(t, d, drafts, 3, io, temperature=1.0)
    with pytest.raises(ValueError, match="io"):
        accept(t, d, drafts, 2, cuda.device_array(2, np.int64), temperature=1.0)
    with pytest.raises(ValueError, match="drafts int64"):
        accept(t, d, cuda.device_array(4, np.int32), 2, io, temperature=1.0)


def test_accept_kernels_compile_for_sm90():
    from kernels import spec_accept
    counts = ptx_counts([f"spec_accept:{k}" for k in spec_accept.SIGNATURES], ["local.u8"])
    assert all(c["sm90"] for c in counts.values()), counts
