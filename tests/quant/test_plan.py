"""Bit plan and size table."""
import pytest

from ds4lib.config import ModelConfig
from ds4lib.formats.gguf import base_file_layout
from ds4lib.quant import default_n13, format_size_table, parse_bits_plan, size_table
from ds4lib.quant.plan import SEED_SIZE_TABLE_GB


def test_default_plan_scales_the_seeds_14_of_40():
    assert [default_n13(n) for n in (40, 8, 4, 2, 1)] == [14, 3, 1, 1, 0]
    v41 = ModelConfig.v41_flash()
    p = parse_bits_plan("auto", v41)
    assert p.bits == (13,) * 14 + (12,) * 26 + (12,) * 3 and p.n13 == 14


def test_plan_specs_and_errors():
    cfg = ModelConfig.tiny()                   # 8 layers + 2 DSpark stages
    assert parse_bits_plan("0", cfg).bits == (12,) * 10
    assert parse_bits_plan("8", cfg).bits == (13,) * 8 + (12, 12)
    assert parse_bits_plan("13,12,13,12,12,12,12,12", cfg).bits == (13, 12, 13) + (12,) * 7
    for bad in ("9", "x", "13,12", "14,12,12,12,12,12,12,12", "12,12,12,12,12,12,12,12,13,12"):
        with pytest.raises(ValueError):
            parse_bits_plan(bad, cfg)


def test_size_table_of_the_real_model_against_the_seed():
    cfg = ModelConfig.v41_flash()
    plan = parse_bits_plan("auto", cfg)
    t = size_table(cfg, base_file_layout(cfg, plan.bits), 0, plan.bits)
    gb = {r["key"]: r["gb"] for r in t["rows"]}
    # the VQ parts are the seed's to the rounding of its table
    for key in ("indices", "gains", "draft"):
        assert gb[key] == pytest.approx(SEED_SIZE_TABLE_GB[key], abs=0.011), key
    assert gb["codebooks"] < 0.003 and gb["q4k"] == pytest.approx(4.96, abs=0.05)
    assert t["total_gb"] == pytest.approx(SEED_SIZE_TABLE_GB["total"], rel=0.005)
    assert t["q4k_fallback_tensors"] == {"q8_0": 0, "f16": 0}          # the real shapes need no fallback
    assert "VQ-8, 26 layers x 12 bit + 14 layers x 13 bit" in format_size_table(t)
