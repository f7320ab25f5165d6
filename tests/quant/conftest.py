import pytest

from ds4lib.config import ModelConfig
from ds4lib.synth import write_random_checkpoint


def micro_config():
    """The tiny preset with 4 small experts per layer (2 per DSpark stage): every tensor role, quantized in ~2 s."""
    return ModelConfig.tiny().replace(n_routed_experts=4, n_activated_experts=2, moe_inter_dim=64,
                                      dspark_n_routed_experts=2, dspark_n_activated_experts=1)


@pytest.fixture(scope="session")
def micro_checkpoint(tmp_path_factory):
    return write_random_checkpoint(tmp_path_factory.mktemp("micro") / "ck", micro_config(), seed=7)
