"""`esm-turbo calibrate` and `esm-turbo evaluate` as a user runs them, on a saved stress model."""
import json
import os

from esm_turbo import Calibration
from esm_turbo.cli import main
from esm_turbo.testing import save_stress_model

CAL = "calibration_data/calibration.fasta"
EV = "calibration_data/evaluation.fasta"


def test_calibrate_then_evaluate_from_the_command_line(stress_dir, tmp_path, capsys):
    ckpt = tmp_path / "stress.turbo.safetensors"
    assert main(["calibrate", "--model", str(stress_dir), "--fasta", CAL, "--out", str(ckpt), "--max-tokens", "3000",
                 "--attention-weight", "0.25", "--quiet"]) == 0
    assert Calibration.load(ckpt).config.attention_weight == 0.25  # the recipe as given, in the checkpoint
    umask = os.umask(0)
    os.umask(umask)
    assert ckpt.stat().st_mode & 0o777 == 0o666 & ~umask  # readable like any file the user writes
    report = tmp_path / "eval.json"
    assert main(["evaluate", "--model", str(stress_dir), "--calibration", str(ckpt), "--fasta", EV, "--limit", "2",
                 "--max-steps", "3", "--quiet", "--json", str(report)]) == 0
    result = json.loads(report.read_text())["turbo"]  # one entry per recipe (ablations add theirs)
    assert len(result["sequences"]) == 2
    assert result["overall"]["prefill_max_abs_diff"] <= 1e-5
    assert min(s["decode_cos_mean"] for s in result["sequences"]) > 0.9
    other = save_stress_model(tmp_path / "other", layers=3, hidden=64, heads=4, seed=2)
    capsys.readouterr()
    assert main(["evaluate", "--model", str(other), "--calibration", str(ckpt), "--fasta", EV, "--limit", "1",
                 "--quiet"]) == 2
    assert "made for another model" in capsys.readouterr().err


def test_three_bit_calibration_splits_toward_the_keys(stress_dir, tmp_path):
    """--index-bits 3 --residual none (3 bits all-in): the default recipe's split gives keys 4 and values 2, saved
    resolved; widths named outright stay as given."""
    for extra, widths in (([], (4, 2)), (["--key-index-bits", "3", "--value-index-bits", "3"], (3, 3))):
        ckpt = tmp_path / f"k{len(extra)}.safetensors"
        assert main(["calibrate", "--model", str(stress_dir), "--fasta", CAL, "--out", str(ckpt), "--max-tokens",
                     "1000", "--index-bits", "3", "--residual", "none", "--quiet", *extra]) == 0
        cal = Calibration.load(ckpt)
        assert (cal.config.key_index_bits, cal.config.value_index_bits, cal.config.split) == (*widths, "as-given")
        assert (cal.codecs[0].key.bits, cal.codecs[0].value.bits) == widths
    # ablations of a 3-bit checkpoint hold its memory: no sign bit added (no-rotation: 4 and 2 bits, no residual)
    report = tmp_path / "ablation.json"
    assert main(["evaluate", "--model", str(stress_dir), "--calibration", str(tmp_path / "k0.safetensors"), "--fasta",
                 EV, "--limit", "1", "--max-steps", "2", "--quiet", "--json", str(report), "--ablations", "no-rotation",
                 "--calibration-fasta", CAL]) == 0
    reports = json.loads(report.read_text())
    per_token = [reports[n]["memory"]["bytes_per_token_per_layer"] for n in ("turbo", "no-rotation")]
    assert per_token[0] == per_token[1] == 48  # 4 heads × d16 × (4 + 2) bits / 8
    ablation = reports["no-rotation"]["config"]
    assert (ablation["key_index_bits"], ablation["value_index_bits"], ablation["residual"]) == (4, 2, "none")


def test_calibrate_measures_a_held_out_part_and_auto_keeps_the_best_recipe(stress_dir, tmp_path, capsys):
    from esm_turbo.fasta import read_fasta, write_fasta
    from esm_turbo.model.holdout import AUTO_CANDIDATES, _rank
    small = tmp_path / "small.fasta"
    write_fasta(small, [(r.id, r.sequence[:120]) for r in read_fasta(CAL)[0][:12]])
    ckpt = tmp_path / "auto.safetensors"
    assert main(["calibrate", "--model", str(stress_dir), "--fasta", str(small), "--out", str(ckpt), "--preset", "auto",
                 "--holdout", "0.25", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "expect, on 3 held-out sequences: mean decode cos" in out
    assert all(f"{name} " in out for name in AUTO_CANDIDATES)
    meta = Calibration.load(ckpt).meta
    assert meta["calibration_sequences"] == 9 and meta["holdout_sequences"] == 3
    tried = meta["preset_auto"]
    assert set(tried) == set(AUTO_CANDIDATES) and meta["preset"] in tried
    assert all(_rank(tried[meta["preset"]]) >= _rank(s) for s in tried.values())
    assert meta["holdout"] == tried[meta["preset"]]
    assert 0.5 < meta["holdout"]["decode_cos_min"] <= meta["holdout"]["decode_cos_mean"] <= 1
    capsys.readouterr()
    assert main(["calibrate", "--model", str(stress_dir), "--fasta", str(small), "--out", str(ckpt), "--preset", "auto",
                 "--holdout", "0", "--quiet"]) == 2
    assert "--preset auto picks a recipe on a held-out part" in capsys.readouterr().err


def test_calibrate_to_an_all_in_budget(stress_dir, tmp_path, capsys):
    """--bits B stores B bits a value all-in: B − 1 index bits and a sign; at 4 also a slot a token paid for by the
    fewest layers narrowed (4 heads of 16: a slot costs 0.5 bits a value, so two of the three layers); a recipe flag
    given is kept (--predict-values: a predictor a layer, no bytes a token, and evaluate reads it; at 2 and 3 the keys
    alone, 3 + sign and 4 + sign, the values not stored); --bits with
    --index-bits is refused before any work."""
    from esm_turbo.cache import KVCache
    ckpt = tmp_path / "budget.safetensors"
    common = ["calibrate", "--model", str(stress_dir), "--fasta", CAL, "--out", str(ckpt), "--max-tokens", "1500",
              "--holdout", "0", "--quiet"]
    for bits, extra, slots, narrowed in ((4, [], 1, 2), (4, ["--slots", "0"], 0, 0), (3, [], 0, 0),
                                         (4, ["--predict-values"], 0, 0), (3, ["--predict-values"], 0, 0),
                                         (2, ["--predict-values"], 0, 0)):
        assert main([*common, "--bits", str(bits), *extra]) == 0
        out = capsys.readouterr().out
        assert f"recipe for {bits} bits a value all-in" in out
        predicted = extra == ["--predict-values"]
        keys_alone = predicted and bits < 4  # keys 3 + 1 at 2 bits, 4 + 1 at 3 (2.5 bits all-in)
        assert ("values coded as what the keys do not predict" in out) == (predicted and not keys_alone)
        assert ("values not stored" in out) == keys_alone
        if keys_alone:
            assert f"{bits + 1} + 0 index bits" in out
        cal = Calibration.load(ckpt)
        assert cal.config.slots == slots and len(cal.meta.get("narrowed_layers", [])) == narrowed
        assert all((c.predictor is not None) == cal.config.predict_values for c in cal.codecs)
        report = KVCache(cal.codecs, 1, capacity=1, device="cpu").memory_report()
        assert report.bits_per_value <= bits and (bits - report.bits_per_value < 0.5 or not slots)
        if keys_alone:
            assert report.bits_per_value == bits - (bits == 3) / 2  # 2.0 and 2.5
        elif not slots:
            assert report.bits_per_value == bits
    assert main(["evaluate", "--model", str(stress_dir), "--calibration", str(ckpt), "--fasta", EV, "--limit", "1",
                 "--max-steps", "3", "--quiet"]) == 0  # the last: keys alone, values predicted
    assert main([*common, "--bits", "4", "--index-bits", "3"]) == 2
    assert "not both" in capsys.readouterr().err


def test_holdout_split_is_seeded_disjoint_and_bounded():
    from esm_turbo.fasta import read_fasta
    from esm_turbo.model.holdout import MAX_HELD_OUT, split_holdout
    records = read_fasta(CAL)[0]
    fit, held = split_holdout(records, 0.2, seed=3)
    assert (fit, held) == split_holdout(records, 0.2, seed=3)
    assert len(held) == 23 and len(fit) == len(records) - 23
    assert not {r.id for r in fit} & {r.id for r in held}
    assert len(split_holdout(records, 0.5)[1]) == MAX_HELD_OUT
    assert split_holdout(records, 0.0) == (records, [])
    assert len(split_holdout(records[:2], 0.1)[1]) == 1  # a share that rounds to none still holds one out


def test_paper_recipe_measurable_past_fp16_and_a_failing_ablation_keeps_the_others(tmp_path, capsys, monkeypatch):
    """Keys 10^5 times their scale: the paper's unscaled per-head LUTs overflow fp16 and are kept in fp32 (decoded on
    the PyTorch path, saved and loaded as such); an ablation that fails is an error row, the other rows stay."""
    import torch
    from esm_turbo import TurboEsm, calibrate, read_fasta
    from esm_turbo.model.checkpoint import PRESETS
    from esm_turbo.testing import plant_outliers, stress_esm2
    model = plant_outliers(stress_esm2(layers=2, hidden=64, heads=4, seed=3, outlier_scale=1.0), 1e5, seed=0,
                           min_scale=1e5)
    model.save_pretrained(tmp_path / "big")
    recs = read_fasta(CAL)[0][:20]
    cal = calibrate(model, recs, PRESETS["paper"], progress=False)
    assert any(c.key.wide for c in cal.codecs)
    path = cal.save(tmp_path / "paper.safetensors")
    loaded = type(cal).load(path)
    assert [c.key.wide for c in loaded.codecs] == [c.key.wide for c in cal.codecs]
    k = torch.randn(1, 4, 5, 16) * 1e4
    for a, b in zip(cal.codecs, loaded.codecs):
        torch.testing.assert_close(b.key.decode(b.key.encode(k)), a.key.decode(a.key.encode(k)))
    session = TurboEsm(model, loaded).session()
    session.start(["MKTAYIAKQRQ"])
    assert torch.isfinite(session.step(["A"]).logits).all()

    import esm_turbo.model.calibrate as calibrate_module
    real = calibrate_module.calibrate

    def failing(model, records, config, **kw):
        if config.lut == "head":
            raise ValueError("planted failure")
        return real(model, records, config, **kw)

    monkeypatch.setattr(calibrate_module, "calibrate", failing)
    out = tmp_path / "ablations.json"
    assert main(["evaluate", "--model", str(tmp_path / "big"), "--calibration", str(path), "--fasta", EV, "--limit",
                 "1", "--max-steps", "2", "--quiet", "--ablations", "head-lut", "no-rotation", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert rows["head-lut"] == {"error": "ValueError: planted failure"}
    assert rows["turbo"]["overall"]["decode_tokens"] == 2 and rows["no-rotation"]["overall"]["decode_tokens"] == 2
