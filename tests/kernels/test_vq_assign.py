"""VQ assignment and Lloyd-update kernels (kernels/vq_assign.py, kernels/vq_accumulate.py) against the CPU path
of ds4lib.solvers.vq: identical indices and integer sums, hence identical codebooks and files (by hash).
Simulator shapes are tiny (it runs ~1e5 vector-codeword pairs per second); a real GPU adds full-size cases."""
import hashlib
import json
import os
from pathlib import Path

import numpy as np
import pytest
from numba import cuda

from ds4lib.solvers.vq import CpuLloyd, assign_reference, prepare_codebook, round_sig12, train_codebook
from kernels.vq_assign import round_sig12_device
from tests.kernels.compile_sm90 import ptx_counts

SIM = os.environ.get("NUMBA_ENABLE_CUDASIM", "0") not in ("", "0")
ROOT = Path(__file__).resolve().parents[2]
# (vectors, codewords): small K; two codebook chunks with a ragged tail; two blocks with a ragged tail
CASES = [(200, 40), (40, 515), (1030, 6)] + ([] if SIM else [(100_003, 4096), (5000, 8192)])


@cuda.jit
def _round_sig12_kernel(x, out):             # module level: the simulator swaps the global name `cuda` only
    i = cuda.grid(1)
    if i < x.shape[0]:
        out[i] = round_sig12_device(x[i])


def _sha(*arrays):
    h = hashlib.sha256()
    for a in arrays:
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()


@pytest.mark.parametrize("n,k", CASES)
def test_assign_kernel_matches_cpu(cuda_ready, n, k):
    from kernels.vq_assign import vq_assign
    rng = np.random.default_rng(n + k)
    x = (rng.standard_normal((n, 8)) * rng.uniform(0.1, 3, (n, 1))).astype(np.float32)
    cb = rng.standard_normal((k, 8)).astype(np.float32)
    cb[k - 1] = cb[0]                                     # a tie: the lower index must win on both paths
    p = prepare_codebook(cb)
    got = vq_assign(cuda_ready.to_device(x), cuda_ready.to_device(p.cbm2), cuda_ready.to_device(p.cnorm))
    got = got.copy_to_host()
    cpu = CpuLloyd()
    assert np.array_equal(got, cpu.fetch(cpu.assign(cpu.put(x), p)))
    if n * k <= 200_000:
        assert np.array_equal(got, assign_reference(x, p))


def test_round_sig12_device_matches_numpy(cuda_ready):
    rng = np.random.default_rng(9)
    x = (rng.standard_normal(250) * np.exp(rng.uniform(-30, 30, 250))).astype(np.float32)
    x = np.concatenate([x, np.float32([0, -0.0, 1 + 2 ** -12, 1 + 3 * 2 ** -12, -(1 + 2 ** -12), 2.0 ** -61,
                                       2.0 ** -60, 3e38])])
    out = cuda_ready.device_array(x.shape, np.float32)
    _round_sig12_kernel[(x.size + 63) // 64, 64](cuda_ready.to_device(x), out)
    assert np.array_equal(out.copy_to_host().view(np.uint32), round_sig12(x).view(np.uint32))


@pytest.mark.parametrize("n,k", [(300, 7)] + ([] if SIM else [(1_000_000, 4096)]))
def test_accumulate_kernel_matches_cpu(cuda_ready, n, k):
    from kernels.vq_accumulate import vq_accumulate
    rng = np.random.default_rng(k)
    x = (rng.standard_normal((n, 8)) * 5).astype(np.float32)
    idx = rng.integers(0, k, n).astype(np.int32)
    idx[idx == 1] = 2                                     # an empty codeword
    sums, counts = vq_accumulate(cuda_ready.to_device(x), cuda_ready.to_device(idx), k)
    cpu = CpuLloyd()
    want_s, want_c = cpu.accumulate(cpu.put(x), idx, k)
    assert np.array_equal(sums.copy_to_host(), want_s) and np.array_equal(counts.copy_to_host(), want_c)


def test_lloyd_on_cuda_gives_the_cpu_bytes(cuda_ready):
    from ds4lib.quant.cuda_backend import CudaLloyd
    n, k, rounds = (300, 24, 2) if SIM else (200_000, 4096, 6)
    pool = np.random.default_rng(5).standard_normal((n, 8)).astype(np.float32)
    gpu, cpu = CudaLloyd(), CpuLloyd()
    a = train_codebook(pool, k, rounds, gpu)
    b = train_codebook(pool, k, rounds, cpu)
    pa, pb = prepare_codebook(a.codebook), prepare_codebook(b.codebook)
    ia = gpu.fetch(gpu.assign(gpu.put(pool), pa))
    ib = cpu.fetch(cpu.assign(cpu.put(pool), pb))
    assert _sha(a.codebook_f32, a.codebook, ia) == _sha(b.codebook_f32, b.codebook, ib)


def test_vq_kernels_compile_for_sm90_in_registers():
    """PTX for sm_90: the assignment keeps its vectors in registers (no local memory) and the update uses
    64-bit integer atomics (order-independent)."""
    r = ptx_counts(["vq_assign:vq_assign_kernel", "vq_accumulate:vq_accumulate_kernel"],
                   [".local", "bar.sync", "atom.global.add.u64", "atom.global.add.f"])
    pa, pu = r["vq_assign:vq_assign_kernel"], r["vq_accumulate:vq_accumulate_kernel"]
    r = {"target": pa["sm90"], "local": pa[".local"], "bar": pa["bar.sync"] > 0, "atom64": pu["atom.global.add.u64"],
         "fatom": pu["atom.global.add.f"]}
    assert r == {"target": True, "local": 0, "bar": True, "atom64": 9, "fatom": 0}, r


def test_quantize_file_cuda_equals_cpu(cuda_ready, tmp_path):
    """The whole base file, CPU path vs CUDA path: the same bytes (real GPU only)."""
    if SIM:
        pytest.skip("whole-file CUDA quantization needs a real GPU (DS4_REQUIRE_CUDA=1 runs it)")
    from ds4lib.config import ModelConfig
    from ds4lib.quant import quantize_checkpoint
    from ds4lib.synth import write_random_checkpoint
    cfg = ModelConfig.tiny().replace(n_routed_experts=4, n_activated_experts=2, moe_inter_dim=64,
                                     dspark_n_routed_experts=2, dspark_n_activated_experts=1)
    ck = write_random_checkpoint(tmp_path / "ck", cfg, seed=3)
    a = quantize_checkpoint(checkpoint=ck, out=tmp_path / "cpu.gguf", rounds=3, device="cpu", progress=False)
    b = quantize_checkpoint(checkpoint=ck, out=tmp_path / "gpu.gguf", rounds=3, device="cuda", progress=False)
    assert a.sha256 == b.sha256


@pytest.mark.filterwarnings("ignore::RuntimeWarning")        # the simulator's uint64 hash wraps in NumPy
@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_bench_lloyd_smoke(cuda_ready, device, capsys):
    """bench/bench_lloyd.py (the H200 measurement) runs end to end and prints its JSON line."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("bench_lloyd", ROOT / "bench" / "bench_lloyd.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.main(["--device", device, "--tiny"]) == 0
    rec = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    r = rec["5"]
    assert rec["device"] == device and r["codewords"] == 32 and r["layer_vectors"] == 600
    assert r["assign_vec_cw_per_s"] > 0 and r["train_s_per_round"] > 0
