"""Structured configs of an experiment, registered with Hydra's ConfigStore: one schema for the CLI,
the Python API and ``scripts/experiment.py`` (``conf/`` holds the named choices of each group).

TurboESM recipes are the package's own :data:`~esm_turbo.model.checkpoint.PRESETS` (``quant.recipe``)
with optional bit / residual overrides, so a sweep calibrates exactly what ``esm-turbo calibrate`` does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from ..model.family import family_of
from ..model.recipe import CalibrationConfig, for_budget, recipe
from ..schema import overrides_schema, set_fields


@dataclass
class ModelConf:
    """``kind``: stress (a built stress model, see esm_turbo.testing) or pretrained (``path``: a released ESM-2 or
    a testbed trained on real proteins). ``outliers`` > 0 plants function-preserving K/V outliers up to that
    many times a channel's scale (:func:`esm_turbo.testing.plant_outliers`, seed ``outlier_seed``)."""

    name: str = "stress-6L-d64"
    kind: str = "stress"
    path: str = ""
    layers: int = 6
    hidden: int = 256
    heads: int = 4
    seed: int = 0
    outliers: float = 0.0
    outlier_seed: int = 0


@dataclass
class DataConf:
    name: str = "default"  # rows of another calibration set are stored as <quant>@<name>.json
    calibration: list[str] = field(default_factory=lambda: ["calibration_data/calibration.fasta"])
    evaluation: list[str] = field(default_factory=lambda: ["calibration_data/evaluation.fasta"])
    eval_every: int = 1  # take every n-th evaluation record
    calibration_samples: int = 8192  # tokens of K/V kept per layer to fit the calibrated baselines


#: a Hydra node of :class:`CalibrationConfig`'s fields, each optional: those set override the recipe's
CalibrationOverrides = overrides_schema(CalibrationConfig, "CalibrationOverrides")


@dataclass
class QuantConf:
    """A KV-compression method. ``method``: dense | int | fp8 | turboquant | turboesm | outlier | rvq.

    turboesm: ``recipe`` (a PRESETS name) at ``index_bits`` mean index bits per value (None: the recipe's), with the
    fields set under ``calibration`` (:class:`~esm_turbo.model.recipe.CalibrationConfig`'s) overriding it — exactly
    what ``esm-turbo calibrate --preset R --index-bits B --FIELD V`` calibrates; or ``bits`` all-in bits a value
    (``calibrate --bits B``: the recipe made for that budget in the model, the fields set kept). dense: ``dtype``;
    int: ``bits`` (keys per channel, values per token), ``window``; turboquant: ``bits``, ``residual`` (none/qjl);
    outlier: ``bits`` (regular), ``outlier_bits``, ``outlier_frac``; rvq: ``depth``, ``group``.
    """

    name: str = "turboesm"
    method: str = "turboesm"
    recipe: str = "default"
    index_bits: Optional[int] = None
    calibration: CalibrationOverrides = field(default_factory=CalibrationOverrides)
    bits: Optional[int] = None
    dtype: str = "fp16"
    residual: Optional[str] = None
    outlier_bits: int = 8
    outlier_frac: float = 0.125
    depth: int = 3
    group: int = 8
    window: int = 0  # int: the most recent tokens kept in fp16 (KIVI's residual window)

    def calibration_config(self, shape=None) -> CalibrationConfig:
        """turboesm's recipe; with ``bits`` the one for that all-in budget in a model of ``shape`` (its config)."""
        fields = set_fields(self.calibration)
        cfg = recipe(self.recipe, self.index_bits, **fields)
        if self.bits is None:
            return cfg
        if self.index_bits is not None:
            raise ValueError("quant: give bits (all-in bits a value) or index_bits, not both")
        if shape is None:
            raise ValueError("quant.bits: the recipe for a budget needs the model's shape")
        heads = shape.num_attention_heads
        return for_budget(cfg, self.bits, shape.num_hidden_layers, heads, shape.hidden_size // heads,
                          keep=frozenset(fields), family=family_of(shape).name)


@dataclass
class EvalConf:
    prefix_fraction: float = 0.5
    max_steps: Optional[int] = None  # decode at most this many residues per sequence (None: the rest of it)


@dataclass
class HardwareConf:
    device: str = "cpu"
    threads: int = 2


@dataclass
class ExperimentConf:
    model: ModelConf = field(default_factory=ModelConf)
    data: DataConf = field(default_factory=DataConf)
    quant: QuantConf = field(default_factory=QuantConf)
    eval: EvalConf = field(default_factory=EvalConf)
    hardware: HardwareConf = field(default_factory=HardwareConf)
    sweep: str = "methods"
    out: str = "results/rows"


def register() -> None:
    """Make the schema known to Hydra (``conf/config.yaml`` names ``base_experiment`` as its base)."""
    from hydra.core.config_store import ConfigStore
    cs = ConfigStore.instance()
    cs.store(name="base_experiment", node=ExperimentConf)
    for group, node in (("model", ModelConf), ("data", DataConf), ("quant", QuantConf), ("eval", EvalConf),
                        ("hardware", HardwareConf)):
        cs.store(group=group, name=f"base_{group}", node=node)
