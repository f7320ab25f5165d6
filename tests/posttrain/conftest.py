"""The micro stack the ③ tests share: the sidecar tests' micro checkpoint (the tokenizer copied in, so that the engine
and the CLI find it), its ① base and a random ② sidecar whose gains are far from 1 (±40 % on every layer, so that a
wrong account of where ye is taken shows) with a router bias on layer 0. Built once per test session."""
import shutil

import numpy as np
import pytest

from tests.engine.test_engine_cuda import TOKENIZER
from tests.sidecar.test_solve import micro_config


@pytest.fixture(scope="session")
def micro_stack(tmp_path_factory):
    """{"root", "ckpt", "base", "sc", "cfg"}."""
    from ds4lib.formats.sidecar import write_sidecar
    from ds4lib.quant.base_file import quantize_checkpoint
    from ds4lib.synth import write_random_checkpoint
    cfg = micro_config()
    E, D, L = cfg.n_routed_experts, cfg.dim, cfg.n_layers
    root = tmp_path_factory.mktemp("posttrain_micro")
    ckpt = write_random_checkpoint(root / "ckpt", cfg, seed=0)
    shutil.copy(TOKENIZER, ckpt / "tokenizer.json")
    base = root / "base.gguf"
    quantize_checkpoint(checkpoint=ckpt, out=base, bits_plan="1", rounds=1, progress=False)
    rng = np.random.default_rng(1)
    sc = write_sidecar(root / "sc", cfg, kind="sidecar", gain_deltas={l: rng.uniform(-0.4, 0.4, (E, D))
                                                                      for l in range(L)},
                       bias={0: rng.normal(0, 0.1, E)})
    return {"root": root, "ckpt": ckpt, "base": base, "sc": sc, "cfg": cfg}
