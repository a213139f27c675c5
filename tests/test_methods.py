"""The method zoo of the sweeps: exact byte accounting, sane fidelity ordering, Hydra configs that run."""

from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from esm_turbo.cache import KVCache
from esm_turbo.experiments.config import ExperimentConf, QuantConf, register
from esm_turbo.experiments.methods import build_codecs, layout_codecs
from esm_turbo.testing import stress_esm2

CONF = Path(__file__).resolve().parents[1] / "conf"
QUANTS = sorted(p.stem for p in (CONF / "quant").glob("*.yaml"))


def quant_conf(name: str) -> QuantConf:
    raw = {k: v for k, v in OmegaConf.load(CONF / "quant" / f"{name}.yaml").items() if k != "defaults"}
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(QuantConf), raw))


@pytest.fixture(scope="module")
def tiny():
    model = stress_esm2(layers=1, hidden=64, heads=2, seed=3)  # head_dim 32
    gen = torch.Generator().manual_seed(0)
    samples = [(torch.randn(2, 768, 32, generator=gen) * 3, torch.randn(2, 768, 32, generator=gen))
               for _ in range(1)]
    return model, samples


@pytest.mark.parametrize("name", QUANTS)
def test_bits_per_value_match_the_bytes_held(name, tiny):
    model, samples = tiny
    from esm_turbo.fasta import read_fasta
    cal = read_fasta("calibration_data/calibration.fasta")[0][:6]
    codecs, _ = build_codecs(quant_conf(name), model, cal, lambda: samples)
    tokens = 37
    cache = KVCache(codecs, batch_size=3, capacity=tokens)
    k = torch.randn(3, 2, tokens, 32) * 3  # drawn like the samples the calibrated baselines were fitted on
    v = torch.randn(3, 2, tokens, 32)
    cache.append([k], [v])
    rep = cache.memory_report()
    held = sum(b.numel() * b.element_size() for layer in cache.parts for b in layer.values())
    window = cache.window.nbytes() if cache.window is not None else 0
    assert held + window == rep.allocated_bytes and window == rep.window_bytes
    assert (window > 0) == (getattr(codecs[0], "window", 0) > 0)
    assert rep.bits_per_value * (3 * tokens * 2 * 2 * 32) == pytest.approx(8 * held)
    if name.startswith("turboesm"):
        return  # fitted to the model's own activations, not to these random vectors: bytes only
    k_hat, v_hat, _ = cache.dequantize(0)
    bound = {"fp32": 1e-6, "fp16": 1e-3}.get(name, 0.5 if rep.bits_per_value >= 3.5 else 1.5)
    for x, x_hat in ((k, k_hat), (v, v_hat)):
        err = ((x_hat - x).norm() / x.norm()).item()
        assert err < bound, err


def rel_err(name, tiny):
    model, samples = tiny
    codec = build_codecs(quant_conf(name), model, [], lambda: samples)[0][0]
    x = samples[0][0][:, None, :256]  # [H, 1, T, d] → use as [..., H, T, d] with a batch of 1
    x = x.permute(1, 0, 2, 3)
    parts = codec.key.encode(x)
    return ((codec.key.decode(parts) - x).norm() / x.norm()).item()


@pytest.mark.parametrize("family", [("int2", "int4", "int8"), ("rvq2", "rvq3", "rvq4"),
                                    ("turboquant2", "turboquant3", "turboquant4"), ("tq25", "tq35")])
def test_more_bits_less_error(family, tiny):
    errs = [rel_err(n, tiny) for n in family]
    assert errs == sorted(errs, reverse=True), dict(zip(family, errs))


def test_layout_matches_fitted_codecs(tiny):
    for name in ("tq35", "rvq3", "int4", "turboesm", "fp8"):
        fitted = build_codecs(quant_conf(name), tiny[0], [], lambda: tiny[1])[0][0] if name != "turboesm" else None
        layout = layout_codecs(quant_conf(name), 2, 32)
        if fitted is not None:
            assert layout.part_specs() == fitted.part_specs()
        assert layout.bytes_per_token() > 0


def test_hydra_config_composes_and_runs(tmp_path):
    from hydra import compose, initialize_config_dir
    from esm_turbo.experiments.runner import run_experiment
    register()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("config", overrides=["quant=tq35", "model=stress4", "data.eval_every=10", "eval.max_steps=2",
                                           f"out={tmp_path}"])
    exp = OmegaConf.to_object(cfg)
    assert isinstance(exp, ExperimentConf) and exp.quant.outlier_bits == 4
    row = run_experiment(exp)
    assert (tmp_path / "methods" / "stress-4L-d16" / "tq35.json").is_file()
    assert 0 < row["decode_cos_mean"] <= 1 and row["bits_per_value"] > 3 and row["device"] == "cpu"


def test_kivi_window_keeps_recent_tokens_in_fp16(tiny):
    model, samples = tiny
    codecs, _ = build_codecs(quant_conf("int2"), model, [], lambda: samples)
    window = codecs[0].window
    assert window == 32
    cache = KVCache(codecs, batch_size=2, capacity=8)
    k = torch.randn(2, 2, 100, 32) * 3
    valid = torch.ones(2, 100, dtype=torch.bool)
    valid[1, 60:] = False  # a ragged prefill: row 1 has 60 tokens
    cache.write(0, k, k, valid)
    cache.commit(valid.sum(1))
    k_hat, _, _ = cache.dequantize(0)
    recent0, recent1 = k[0, :, 100 - window: 100], k[1, :, 60 - window: 60]
    assert torch.allclose(k_hat[0, :, 100 - window: 100], recent0.half().float())
    assert torch.allclose(k_hat[1, :, 60 - window: 60], recent1.half().float())
    assert (k_hat[0, :, : 100 - window] - k[0, :, : 100 - window]).abs().max() > 0.1  # older: INT2
    # a peek (write, no commit) leaves the window as it was; a rollback shrinks it
    cache.write(0, k[:, :, :5], k[:, :, :5])
    after, _, valid_pos = cache.dequantize(0)
    mask = valid_pos[:, None, :, None]
    assert torch.equal(after * mask, k_hat * mask)
    cache.truncate(10)
    k_back, _, _ = cache.dequantize(0)
    assert torch.allclose(k_back[0, :, 90 - window: 90], k[0, :, 90 - window: 90].half().float())


def test_one_registry_serves_the_engine_and_the_sweeps(tiny):
    """Every sweep preset names a registered method; the engine builds the shape-only ones by kind (a new method
    registered once is usable by both), and refuses kinds that need data, naming what it takes."""
    from esm_turbo.model.engine import TurboEsm
    from esm_turbo.quant.fit import oblivious_codec
    from esm_turbo.quant.registry import KV_METHODS, MethodRequest, Quantizer, build_codecs as registry_build, register
    for conf in sorted((Path(__file__).resolve().parents[1] / "conf" / "quant").glob("*.yaml")):
        assert OmegaConf.load(conf).method in KV_METHODS, conf.name
    engine = TurboEsm(stress_esm2(layers=2, hidden=32, heads=2))
    four = engine.codecs("turboquant-4")[1]
    want = oblivious_codec(engine.heads, engine.head_dim, 4, "hadamard", "none", seed=1)
    k, v = torch.randn(1, engine.heads, 5, engine.head_dim), torch.randn(1, engine.heads, 5, engine.head_dim)
    assert all(torch.equal(a, b) for a, b in zip(four.decode(four.encode(k, v)), want.decode(want.encode(k, v))))
    fp8, fp16 = engine.codecs("fp8")[0], engine.codecs("fp16")[0]
    assert fp8.bytes_per_token() < fp16.bytes_per_token()
    with pytest.raises(ValueError, match="turboquant"):
        engine.codecs("int-4")
    codecs, _ = registry_build("int", MethodRequest(2, 16, 2, QuantConf(method="int", bits=4),
                                                    lambda: [(torch.randn(2, 64, 16), torch.randn(2, 64, 16))] * 2))
    assert all(isinstance(q, Quantizer) for c in codecs for q in (c.key, c.value))

    @register("test-dense16", "fp16, registered by a test")
    def _mine(req):
        return registry_build("dense", MethodRequest(req.heads, req.dim, req.layers, QuantConf(dtype="fp16")))
    try:
        assert len(engine.codecs("test-dense16")) == 2
        q = QuantConf(method="test-dense16")
        assert len(build_codecs(q, engine.model, [], lambda: [])[0]) == 2
    finally:
        del KV_METHODS["test-dense16"]
