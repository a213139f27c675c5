"""What a calibration should expect: hold part of the calibration set out, measure the checkpoint on it, and
(``preset="auto"``) pick the recipe that holds best there.

The held-out part is decoded as :func:`esm_turbo.model.evaluate.evaluate` does (first half prefilled, the rest
fed one token a step, teacher-forced, against an FP32 cache); its summary — mean decode cos, worst sequence,
worst token, share of tokens under 0.95 — is stored in the checkpoint's metadata under ``"holdout"``.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace

from ..fasta import Record
from .calibrate import calibrate
from .checkpoint import PRESETS, Calibration, CalibrationConfig, with_mean_bits
from .engine import TurboEsm
from .evaluate import evaluate

#: the recipes ``--preset auto`` tries, all at the same bytes per token
AUTO_CANDIDATES = ("default", "query-keys", "no-rotation", "keys-first")
#: at most this many held-out sequences are decoded (the split keeps the rest for the fit)
MAX_HELD_OUT = 32
SUMMARY_KEYS = ("decode_cos_mean", "decode_cos_worst_seq", "decode_cos_min", "decode_tail_share", "decode_tokens")


def split_holdout(records: list[Record], fraction: float, seed: int = 0) -> tuple[list[Record], list[Record]]:
    """(fit, held out): a seeded share ``fraction`` of ``records`` (at most :data:`MAX_HELD_OUT`, at least one when
    ``fraction`` > 0 and two records or more) held out; the rest, in their order, is fitted on."""
    if not 0.0 <= fraction < 1.0:
        raise ValueError(f"holdout fraction {fraction} is not in [0, 1)")
    n = min(MAX_HELD_OUT, round(fraction * len(records)))
    if fraction > 0 and len(records) >= 2:
        n = max(1, n)
    if n == 0:
        return list(records), []
    held = set(random.Random(seed).sample(range(len(records)), n))
    return ([r for i, r in enumerate(records) if i not in held], [r for i, r in enumerate(records) if i in held])


def holdout_summary(model, calibration: Calibration, held_out: list[Record], progress: bool = False) -> dict:
    """Decode fidelity of ``calibration`` on ``held_out``: the :data:`SUMMARY_KEYS` of its overall summary."""
    report = evaluate(TurboEsm(model, calibration, check_fingerprint=False), held_out, progress=progress)
    return {k: report["overall"][k] for k in SUMMARY_KEYS} | {"sequences": len(held_out)}


def _rank(summary: dict) -> tuple[float, float, float]:
    """Higher is better: the worst sequence first, then the worst token, then the mean."""
    return summary["decode_cos_worst_seq"], summary["decode_cos_min"], summary["decode_cos_mean"]


@dataclass
class HeldOutCalibration:
    """A calibration measured on a held-out part of its set; ``candidates`` holds each tried recipe's summary
    (``preset="auto"``), ``chosen`` the preset kept."""

    calibration: Calibration
    summary: dict | None
    chosen: str
    candidates: dict


def calibrate_held_out(model, records: list[Record], config: CalibrationConfig | None = None,
                       preset: str = "default", holdout: float = 0.2, seed: int = 0, progress: bool = True,
                       model_name: str = "") -> HeldOutCalibration:
    """Calibrate on ``records`` less a held-out share ``holdout``, measure the checkpoint on that share and store
    the summary in its metadata. ``preset="auto"``: every recipe of :data:`AUTO_CANDIDATES` at ``config``'s index
    bits, residual, slots and narrowed layers is calibrated and measured, and the best on the held-out part
    (:func:`_rank`) is kept."""
    fit, held = split_holdout(records, holdout, seed)
    if preset != "auto":
        cfg = config if config is not None else PRESETS[preset]
        cal = calibrate(model, fit, cfg, progress=progress, model_name=model_name)
        summary = holdout_summary(model, cal, held) if held else None
        _annotate(cal, summary, preset, {}, len(held))
        return HeldOutCalibration(cal, summary, preset, {})
    if not held:
        raise ValueError("--preset auto picks a recipe on a held-out part of the calibration set: give --holdout > 0 "
                         "and at least two sequences")
    base = config if config is not None else PRESETS["default"]
    mean_bits = (base.key_index_bits + base.value_index_bits) // 2
    best: tuple | None = None
    candidates: dict[str, dict] = {}
    keys_alone = base.value_index_bits == 0  # values not stored: every candidate keeps the keys' widths
    for name in AUTO_CANDIDATES:
        if keys_alone and name == "keys-first":  # the same widths as the default's then
            continue
        widths = (dict(key_index_bits=base.key_index_bits, value_index_bits=0, split="as-given") if keys_alone
                  else {})
        cfg = replace(with_mean_bits(PRESETS[name], mean_bits), residual=base.residual, seed=base.seed,
                      max_tokens=base.max_tokens, slots=base.slots, slot_rank=base.slot_rank,
                      narrow_layers=base.narrow_layers, predict_values=base.predict_values, **widths)
        cal = calibrate(model, fit, cfg, progress=progress, model_name=model_name)
        candidates[name] = holdout_summary(model, cal, held)
        if best is None or _rank(candidates[name]) > _rank(best[2]):
            best = (name, cal, candidates[name])
    name, cal, summary = best
    _annotate(cal, summary, name, candidates, len(held))
    return HeldOutCalibration(cal, summary, name, candidates)


def _annotate(cal: Calibration, summary: dict | None, preset: str, candidates: dict, held: int) -> None:
    cal.meta["preset"] = preset
    cal.meta["holdout_sequences"] = held
    if summary is not None:
        cal.meta["holdout"] = summary
    if candidates:
        cal.meta["preset_auto"] = candidates


def format_summary(summary: dict) -> str:
    return (f"mean decode cos {summary['decode_cos_mean']:.4f}, worst sequence {summary['decode_cos_worst_seq']:.4f}, "
            f"worst token {summary['decode_cos_min']:.4f}, {summary['decode_tail_share']:.2%} of "
            f"{summary['decode_tokens']} decode tokens under 0.95")
