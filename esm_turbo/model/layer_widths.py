"""Widths per layer from a measured sensitivity (``CalibrationConfig.narrow_layers``): the layers whose decode
fidelity drops least with one index bit less take it, and the bits they free pay for what the recipe adds elsewhere
(its slots: one layer of a heads-of-16 ESM-2 at 3.0 bits and one slot a token come to 3.933 bits all-in,
``docs/recipe.md``).

Each layer's sensitivity is the mean decode cos lost (as :func:`~esm_turbo.model.evaluate.evaluate` decodes: half of
each sequence prefilled exactly, the rest fed a token a step) when that layer alone takes the narrower recipe's codec
and every other layer keeps the recipe's own, on a seeded sample of the calibration set.
"""

from __future__ import annotations

import random
from dataclasses import replace

from tqdm.auto import tqdm

from ..fasta import Record
from .checkpoint import Calibration, CalibrationConfig, with_mean_bits
from .engine import TurboEsm
from .evaluate import evaluate

#: calibration sequences each layer's sensitivity is measured on (a seeded sample; all where there are fewer)
SENSITIVITY_SEQUENCES = 16


def narrower(config: CalibrationConfig) -> CalibrationConfig:
    """The recipe one index bit narrower a value (its key/value split rule kept: the default's 3.0 bits all-in are
    keys-first), no layers narrowed in turn."""
    mean = (config.key_index_bits + config.value_index_bits) // 2
    if mean <= 1:
        raise ValueError(f"narrow_layers needs a recipe of 2 index bits a value or more (this one has {mean})")
    return replace(with_mean_bits(config, mean - 1), narrow_layers=0)


def sensitivity_sample(records: list[Record], seed: int = 0) -> list[Record]:
    """The calibration sequences the sensitivities are measured on (at least two residues each: one prefilled, one
    decoded)."""
    usable = [r for r in records if len(r.sequence) >= 2]
    if len(usable) <= SENSITIVITY_SEQUENCES:
        return usable
    return [usable[i] for i in sorted(random.Random(seed).sample(range(len(usable)), SENSITIVITY_SEQUENCES))]


def layer_sensitivity(model, wide: Calibration, narrow: Calibration, records: list[Record],
                      progress: bool = False) -> list[float]:
    """Per layer: mean decode cos with ``wide``'s codecs everywhere, less the same with that layer's codec from
    ``narrow`` (on the model's device)."""
    engine = TurboEsm(model, wide, check_fingerprint=False)

    def mean_cos(codecs) -> float:
        report = evaluate(engine, records, cache=lambda layer, h, d: codecs[layer], progress=False)
        return report["overall"]["decode_cos_mean"]

    layers = len(wide.codecs)
    runs = tqdm(range(layers + 1), desc="calibrate: layer sensitivity", disable=not progress, unit="run")
    cos = [mean_cos(wide.codecs if j == layers else [narrow.codecs[i] if i == j else wide.codecs[i]
                                                      for i in range(layers)]) for j in runs]
    return [cos[layers] - c for c in cos[:layers]]


def narrow_least_sensitive(wide: Calibration, narrow: Calibration, sensitivity: list[float],
                           count: int) -> Calibration:
    """``wide`` with its ``count`` least sensitive layers' codecs taken from ``narrow``; the metadata says which,
    each layer's (key, value) index bits and the sensitivities."""
    if not 0 < count < len(wide.codecs):
        raise ValueError(f"narrow_layers {count}: give fewer than the model's {len(wide.codecs)} layers")
    chosen = sorted(sorted(range(len(sensitivity)), key=lambda i: (sensitivity[i], i))[:count])
    pick = [narrow if i in chosen else wide for i in range(len(wide.codecs))]
    codecs = [cal.codecs[i] for i, cal in enumerate(pick)]
    meta = dict(wide.meta, narrowed_layers=chosen, layer_sensitivity=[round(s, 6) for s in sensitivity],
                layer_index_bits=[[cal.config.key_index_bits, cal.config.value_index_bits] for cal in pick])
    if "value_rotation_choice" in wide.meta:
        meta["value_rotation_choice"] = [cal.meta["value_rotation_choice"][i] for i, cal in enumerate(pick)]
    out = Calibration(codecs, wide.config, meta)
    out.seconds = getattr(wide, "seconds", 0.0) + getattr(narrow, "seconds", 0.0)
    return out


__all__ = ["SENSITIVITY_SEQUENCES", "layer_sensitivity", "narrow_least_sensitive", "narrower", "sensitivity_sample"]
