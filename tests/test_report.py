"""The report's fidelity section judges each recipe's worst calibration set against the budget's bars."""

from esm_turbo.experiments.report import fidelity_section


def _row(quant, bits, mean, worst_seq, worst_token, tail):
    return dict(quant=quant, bits_per_value=bits, decode_cos_mean=mean, decode_cos_worst_seq=worst_seq,
                decode_cos_min=worst_token, decode_tail_share=tail)


def test_the_fidelity_section_marks_the_bars_each_recipe_misses(tmp_path):
    rows = {"trained-8M-d16": [
        _row("turboesm", 4.0, 0.997, 0.993, 0.96, 0.0), _row("turboesm", 4.0, 0.997, 0.993, 0.93, 0.001),
        _row("turboesm_budget_4bit", 3.93, 0.997, 0.994, 0.957, 0.0),
        dict(_row("turboesm_predicted_3bit", 2.5, 0.998, 0.994, 0.948, 0.0002), device="cpu"),
        _row("turboesm_default_3bit", 3.0, 0.990, 0.976, 0.92, 0.003),
        _row("turboesm_predicted_2bit", 2.0, 0.99, 0.975, 0.93, 0.0007)]}
    text = fidelity_section(rows, tmp_path)
    four, three, two = (next(s for s in text.split("### ")[1:] if s.startswith(b)) for b in ("4.0", "3.0", "2.0"))
    assert "misses worst token" in next(ln for ln in four.splitlines() if "| default |" in ln)
    assert "| 2 |" in next(ln for ln in four.splitlines() if "| default |" in ln)  # two calibration sets
    assert next(ln for ln in four.splitlines() if "| --bits B |" in ln).endswith("| yes | — |")
    assert "| 2.5 |" in next(ln for ln in three.splitlines() if "--predict-values" in ln)
    assert next(ln for ln in three.splitlines() if "--predict-values" in ln).endswith("| yes | cpu |")
    assert "misses mean, worst seq, tail" in next(ln for ln in three.splitlines() if "| default |" in ln)
    assert "misses worst seq" in next(ln for ln in two.splitlines() if "--predict-values" in ln)
    assert "--bits B |" not in three and "--bits B |" not in two  # no row of its own there
    assert (tmp_path / "plots" / "fidelity_worst_token.png").is_file()
