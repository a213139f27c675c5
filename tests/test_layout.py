"""The code layout object and the one config schema."""

from dataclasses import fields

import pytest
import torch

from esm_turbo.cache import KVCache
from esm_turbo.model.recipe import PRESETS, CalibrationConfig, config_from_meta, recipe
from esm_turbo.quant.layout import CodeLayout, decode_grid
from esm_turbo.testing import random_turbo_codec


@pytest.mark.parametrize("bits,residual,sign,code_bits,parts", [
    (3, "sign", "combined", 4, {"code": 8}),  # the default: one nibble per value, sign fused
    (2, "sign", "combined", 3, {"code": 6}),
    (4, "sign", "plane", 4, {"idx": 8, "sign": 2}),  # 4 + 1 does not fill whole bytes fused
    (3, "none", "none", 3, {"idx": 6}),
])
def test_code_layout_of_a_codec(bits, residual, sign, code_bits, parts):
    q = random_turbo_codec(2, 16, bits, bits, residual, seed=1).key
    code = q.code_layout()
    assert (code.sign, code.code_bits, code.index_bits) == (sign, code_bits, bits)
    assert {name: shape[0] for name, (shape, _) in code.part_specs().items()} == parts
    assert code.part_specs().items() <= q.part_specs().items()
    assert code.all_in_bits == 8 * sum(parts.values()) // 16
    assert code.widest == int(q.widths.max()) + (residual == "sign")
    assert code.fields >= 0  # the test codec's allocation is shared by its heads
    assert CodeLayout.from_op(code.to_op()) == code
    assert q.code_layout() is code  # built once, kept until the widths change
    q.widths.add_(0)
    assert q.code_layout() is not code and q.code_layout() == code


def test_per_head_layouts_and_the_decode_grid():
    q = random_turbo_codec(2, 16, 3, 3, "sign", seed=3, shared=False).key
    code = q.code_layout()
    assert not code.equal_widths and code.per_head().fields == -1
    assert code.kernel_fields() == code.fields
    equal = random_turbo_codec(1, 16, 3, 3, "sign", allocate=False).key.code_layout()
    assert equal.equal_widths and equal.per_head() is equal and equal.kernel_fields() >= 0
    grid = random_turbo_codec(1, 16, 3, 3, "sign", grid=True)
    assert decode_grid(grid.key.code_layout(), grid.value.code_layout()) == max(
        int(q.widths.max()) + 1 for q in (grid.key, grid.value))
    assert decode_grid(equal, equal) == 0
    with pytest.raises(ValueError, match="combined sign"):
        CodeLayout(16, 4, "combined")


def test_the_cache_decides_its_path_once():
    cache = KVCache([random_turbo_codec(2, 16, 3, 3, "sign")], 2, device="cpu")
    assert cache.fused == [False]  # CPU: the PyTorch reference, decided when the cache is built


def test_recipe_flags_and_hydra_nodes_come_from_one_schema():
    from esm_turbo.cli import _config_from_args, build_parser
    from esm_turbo.experiments.config import CalibrationOverrides, QuantConf
    names = {f.name for f in fields(CalibrationConfig)}
    assert {f.name for f in fields(CalibrationOverrides)} == names
    assert all(f.default is None for f in fields(CalibrationOverrides))
    parser = build_parser()
    calibrate = next(a for a in parser._actions if a.dest == "command").choices["calibrate"]
    assert names <= {a.dest for a in calibrate._actions}
    base = ["--model", "8M", "--fasta", "x.fasta", "--out", "c.safetensors"]
    args = calibrate.parse_args(base + ["--rotation", "svd-query", "--no-bit-allocation", "--attention-weight",
                                        "0.25", "--index-bits", "2"])
    cfg = _config_from_args(args)
    assert (cfg.key_rotation, cfg.bit_allocation, cfg.attention_weight) == ("svd-query", False, 0.25)
    assert (cfg.key_index_bits, cfg.value_index_bits) == (2, 2)
    node = QuantConf(recipe="default", index_bits=2,
                     calibration=CalibrationOverrides(key_rotation="svd-query", bit_allocation=False,
                                                      attention_weight=0.25))
    assert node.calibration_config() == cfg  # the same recipe from the CLI and from a sweep


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_a_sweeps_bits_is_calibrate_bits(bits):
    """quant.bits in a sweep is ``calibrate --bits``: the recipe recipe.for_budget makes for the model (the fields set
    kept)."""
    from esm_turbo.experiments.config import CalibrationOverrides, QuantConf
    from esm_turbo.model.recipe import for_budget
    from transformers import EsmConfig
    shape = EsmConfig(num_hidden_layers=4, hidden_size=64, num_attention_heads=4)
    heads = shape.num_attention_heads
    node = QuantConf(bits=bits, calibration=CalibrationOverrides(predict_values=True))
    want = for_budget(recipe("default", predict_values=True), bits, 4, heads, shape.hidden_size // heads,
                      keep=frozenset({"predict_values"}))
    assert node.calibration_config(shape) == want
    with pytest.raises(ValueError, match="model's shape"):
        node.calibration_config()
    with pytest.raises(ValueError, match="not both"):
        QuantConf(bits=bits, index_bits=2).calibration_config(shape)



def test_the_memory_table_lays_out_values_not_stored(tmp_path):
    """The report's memory table over a quant config whose values are not stored: the keys' bytes alone."""
    import shutil
    from pathlib import Path
    from esm_turbo.experiments.report import memory_table
    (tmp_path / "quant").mkdir()
    for name in ("turboesm", "turboesm_keys_alone"):
        shutil.copy(Path("conf/quant") / f"{name}.yaml", tmp_path / "quant")
    table = memory_table(tmp_path)
    assert "| turboesm_keys_alone | 640 | 2.0000 | 8.0000 | 16.0000 | k.code 32, v.none 0 |" in table


def test_recipe_names_and_legacy_checkpoints():
    assert recipe("keys-first", 2).key_index_bits == 3 and recipe().key_rotation == "identity"
    assert recipe(key_rotation="none").key_rotation == "identity"
    assert recipe(key_index_bits=4).split == "as-given"  # widths named outright are kept
    with pytest.raises(ValueError, match="unknown recipe"):
        recipe("nope")
    with pytest.raises(ValueError, match="max_channel_bits 2"):
        recipe(max_channel_bits=2)
    old = config_from_meta({"key_bits": 4, "value_bits": 2, "residual": "none"})
    assert (old.key_index_bits, old.value_index_bits, old.attention_weight) == (4, 2, 0.0)
    assert (old.max_value_channel_bits, old.grid_span) == (None, 0.0)  # fields it predates: their value then
    assert PRESETS["default"] == CalibrationConfig()


def test_one_dtype_map():
    from esm_turbo.embed.extract import DTYPES as embed_dtypes
    from esm_turbo.schema import DTYPES, dtype_of
    assert embed_dtypes is DTYPES and dtype_of("bf16") is torch.bfloat16
    with pytest.raises(ValueError, match="unknown dtype 'fp64'"):
        dtype_of("fp64")
