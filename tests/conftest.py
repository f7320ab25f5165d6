"""Test configuration shared by every test package.

CUDA kernels run under Numba's simulator in the main pytest process unless DS4_REQUIRE_CUDA=1
(real GPU): the simulator must be switched on before the first `numba.cuda` import, so it is set here.
"""
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
GOLDEN = ROOT / "tests" / "golden"
OFFICIAL = GOLDEN / "official_v41_tiny"

if os.environ.get("DS4_REQUIRE_CUDA", "0") in ("", "0"):
    os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")
    sys.setswitchinterval(1e-4)


@pytest.fixture(scope="session")
def official_dir():
    return OFFICIAL


@pytest.fixture(scope="session")
def official_vectors():
    import numpy as np
    return {mode: dict(np.load(OFFICIAL / f"vectors_quant_{mode}.npz")) for mode in ("on", "off")}


@pytest.fixture(scope="session")
def official_models():
    from ds4lib.ref import ReferenceModel
    return {mode: ReferenceModel.load(OFFICIAL / "checkpoint", quant_sim=(mode == "on")) for mode in ("on", "off")}


@pytest.fixture(scope="session")
def tiny_stack(tmp_path_factory):
    """A random tiny checkpoint and its ① base file (2 Lloyd rounds), built once per test session:
    (checkpoint_dir, base_path). Shared by the engine, eval and server tests."""
    from ds4lib.config import ModelConfig
    from ds4lib.quant.base_file import quantize_checkpoint
    from ds4lib.synth import write_random_checkpoint
    root = tmp_path_factory.mktemp("tiny_stack")
    ckpt = write_random_checkpoint(root / "ckpt", ModelConfig.tiny(), seed=0)
    base = root / "base.gguf"
    quantize_checkpoint(checkpoint=ckpt, out=base, rounds=2, progress=False)
    return ckpt, base


def pytest_collection_modifyitems(config, items):
    """DS4_TEST_SHARD=i/n (scripts/test.sh): keep the tests of the files tests/shards.py assigns to shard i."""
    spec = os.environ.get("DS4_TEST_SHARD")
    if not spec:
        return
    from tests import shards
    i, n = shards.parse_shard(spec)
    files = [item.nodeid.split("::")[0] for item in items]
    where = shards.assign(files, n, shards.read_weights(), together=shards.ptx_groups(files))
    keep = [item for item in items if where[item.nodeid.split("::")[0]] == i]
    if len(keep) < len(items):
        kept = set(map(id, keep))
        config.hook.pytest_deselected(items=[item for item in items if id(item) not in kept])
        items[:] = keep
