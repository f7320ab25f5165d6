"""ModelConfig parsing and validation, presets, derived roles, Engram geometry, tensor inventory, counts."""
import json

import pytest

from ds4lib.config import ConfigError, ModelConfig
from ds4lib.engram_geometry import engram_geometry, is_prime
from ds4lib.inventory import parameter_counts, tensor_inventory
from ds4lib.roles import layer_roles


def test_v41_preset_released_values():
    c = ModelConfig.v41_flash()
    assert (c.dim, c.n_layers, c.n_heads, c.head_dim, c.n_routed_experts, c.moe_inter_dim) == (5120, 40, 64, 512, 384, 2304)
    assert c.compress_ratios == (0, 0) + (2,) * 18 + (1,) * 20 + (0, 0, 0)
    assert c.vision_enabled and "vision_config" not in c.extra_keys


def test_engram_geometry_reproduces_released_tables():
    g = engram_geometry(ModelConfig.v41_flash())
    assert g.table_rows == (384006168, 384016682)
    assert g.primes[0][:8] == (16000057, 16000079, 16000081, 16000097, 16000121, 16000129, 16000133, 16000183)
    assert g.multipliers[0] == (76632096046245, 4839876093313, 35959672319349, 73987337458391)
    assert g.multipliers[1] == (67716810739261, 51510806800915, 30921347202721, 82619226485591)
    flat = [p for layer in g.primes for p in layer]
    assert len(set(flat)) == len(flat) and all(is_prime(p) for p in flat)


def test_tiny_geometry_matches_official_vectors(official_dir):
    tm = json.loads((official_dir / "checkpoint" / "engram_token_map.json").read_text())
    g = engram_geometry(ModelConfig.tiny())
    assert [list(p) for p in g.primes] == [sum(layer, []) for layer in tm["primes"]]
    assert [list(o) for o in g.offsets] == tm["offsets"]
    assert [list(m) for m in g.multipliers] == tm["multipliers"]


def test_parameter_counts_of_v41():
    pc = parameter_counts(ModelConfig.v41_flash())
    assert abs(pc["total"] / 1e9 - 763) < 0.5
    assert pc["engram_tables"] == 256 * (384006168 + 384016682)
    assert 15.5e9 < pc["active_per_token"] < 16.5e9
    assert pc["n_tensors"] == 95819          # the census's 96,085 minus 266 vision tensors


def test_tiny_inventory_matches_official_checkpoint(official_dir):
    from ds4lib.formats.safetensors import SafetensorsFile
    f = SafetensorsFile(official_dir / "checkpoint" / "model.safetensors")
    inv = tensor_inventory(ModelConfig.tiny())
    assert set(inv) == set(f.keys())
    for name, spec in inv.items():
        assert (spec.dtype, spec.shape) == (f.dtype(name), f.shape(name)), name


def test_roles_of_v41():
    roles = layer_roles(ModelConfig.v41_flash())
    r = {x.layer: x for x in roles}
    assert r[2].owns_compressor and r[2].compressor_gate and r[2].indexer_owns_k
    assert r[20].owns_compressor and not r[20].compressor_gate and r[20].publishes_candidates
    assert r[24].owns_indexer and not r[24].indexer_owns_k and r[24].consumes_candidates
    assert (r[25].kv_src, r[25].idx_src) == (20, 24) and (r[13].kv_src, r[13].idx_src) == (8, 8)
    assert r[1].engram and r[14].engram and r[37].dspark_target
    assert r[40].is_dspark and r[40].n_experts == 128 and r[40].top_k == 3 and r[40].ratio == 0
    assert r[0].rope_base == 10000 and r[5].rope_base == 160000 and r[5].yarn


def test_both_spellings_give_the_same_config():
    c = ModelConfig.tiny()
    assert ModelConfig.from_dict(c.to_flat_dict()) == c
    assert ModelConfig.from_dict(c.to_hf_dict()) == c


@pytest.mark.parametrize("change, message", [
    ({"hidden_size": 250}, "multiple of the FP8 block"),
    ({"num_hidden_layers": "8"}, "'n_layers' must be an integer"),
    ({"compress_ratios": [0, 0, 2]}, "compress_ratios has 3 entries"),
    ({"kv_source_layer_ids": [3, 4]}, "no KV source at or before it"),
    ({"kv_source_layer_ids": [2, 5]}, "layer 4 \\(ratio 1\\) reads KV source 2 of ratio 2"),
    ({"engram_num_embeddings": [6126, 6333]}, "disagrees with the rows computed"),
    ({"num_key_value_heads": 2}, "requires 1"),
    ({"candidate_topk_blocks": 2}, "erratum N1"),
    ({"rms_norm_eps": float("nan")}, "finite number"),
    ({"dspark_target_layer_ids": [9]}, "not a backbone layer"),
])
def test_validation_names_the_problem(change, message):
    raw = ModelConfig.tiny().to_hf_dict()
    raw["text_config"].update(change)
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_dict(raw)


def test_missing_field_is_named():
    raw = ModelConfig.tiny().to_flat_dict()
    del raw["index_topk"]
    with pytest.raises(ConfigError, match="lacks required field.*index_topk"):
        ModelConfig.from_dict(raw)


def test_unknown_preset():
    with pytest.raises(ConfigError, match="unknown preset"):
        ModelConfig.preset("v9")


@pytest.mark.parametrize("value, on", [(None, False), ("0", False), ("", False), ("1", True)])
def test_env_reads_the_cuda_switches(monkeypatch, value, on):
    """DS4_CUDA_PRIORITY is off unless set to something other than 0 (the streams' priorities are not yet timed on a
    whole step); DS4_CUDA_GRAPHS and DS4_CUDA_PDL are on unless 0."""
    from ds4lib.config import Env
    for name in ("DS4_CUDA_PRIORITY", "DS4_CUDA_GRAPHS", "DS4_CUDA_PDL"):
        monkeypatch.delenv(name, raising=False)
    if value is not None:
        monkeypatch.setenv("DS4_CUDA_PRIORITY", value)
    env = Env.read()
    assert env.cuda_priority is on
    assert env.cuda_graphs and env.cuda_pdl
    monkeypatch.setenv("DS4_CUDA_PDL", "0")
    assert not Env.read().cuda_pdl and Env.read().cuda_priority is on
