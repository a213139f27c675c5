"""The calibration recipe: :class:`CalibrationConfig`, one schema for the Python API, the command line (flags made
from its fields, ``esm_turbo.schema.add_flags``) and Hydra sweeps (``QuantConf.calibration`` nests its fields), and
the named recipes (:data:`PRESETS`). Why the default is what it is: ``docs/recipe.md``."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, Optional

from ..quant.rotations import ROTATION_KINDS

_ROTATIONS = (*ROTATION_KINDS, "none")  # "none" is "identity"


def _f(default, help: str, **meta):
    return field(default=default, metadata=dict(help=help, **meta))


@dataclass(frozen=True)
class CalibrationConfig:
    """A calibration recipe. Bits are *index bits* (a channel's LUT index; the sign residual's bit comes on top):
    the default's 3 index bits + 1 sign bit store 4.0 bits per value all-in."""

    key_index_bits: int = _f(3, "index bits per key value (a mean over channels under bit allocation)",
                             range=(1, 4))
    value_index_bits: int = _f(3, "index bits per value; 0 (with predict_values): values not stored, the prediction "
                                  "from the keys is the value", range=(0, 4))
    split: str = _f("auto", "auto: equal widths under 4 bits per value all-in become keys-first ones (3 -> 4 and 2, "
                            "2 + sign -> 3 and 1), and with predict_values at 4 too (3 + sign -> 4 and 2: the keys "
                            "then code the values as well); as-given: kept", choices=("auto", "as-given"))
    key_rotation: str = _f("identity", "key rotation; identity: keys per channel; svd-query: the keys' PCA turned to "
                                       "lower the score error (preset query-keys)", choices=_ROTATIONS,
                           flags=("--rotation",))
    value_rotation: str = _f("auto", "value rotation; auto: per head, unrotated or svd-scaled, whichever error "
                                     "reaches the output less",
                           choices=(*(r for r in _ROTATIONS if r != "svd-query"), "auto"))
    residual: str = _f("sign", "residual after the index: a sign bit, a QJL sketch, or none",
                       choices=("sign", "qjl", "none"))
    sign_mode: str = _f("bin", "sign magnitudes per LUT bin or per head", choices=("bin", "head"))
    lut: str = _f("auto", "levels: grid (evenly spaced per channel, computed by the GPU kernels), channel (a "
                          "Lloyd-Max LUT per channel), head (one per head, the paper); auto: grid with a sign "
                          "residual, channel without", choices=("auto", "channel", "head", "grid"))
    shared_lut: bool = _f(False, "one LUT for keys and values")
    grid_span: float = _f(0.5, "grid levels: each channel's outer levels moved this share of the way from its "
                               "least-squares range (which clips its rare large values) out to the calibration's "
                               "extremes; 0: the least-squares range", range=(0.0, 1.0))
    max_tokens: Optional[int] = _f(None, "stop after this many calibration tokens", range=(1, None))
    batch_tokens: int = _f(8192, "padded tokens per calibration batch", range=(16, None))
    bins: int = _f(4096, "histogram bins per LUT fit with lut=head", range=(16, None))
    channel_bins: int = _f(512, "histogram bins per channel (values standardised, +-10 rms)", range=(16, None))
    bit_allocation: bool = _f(True, "index widths per channel by its share of the output error (the same bytes); "
                                    "--no-bit-allocation: every channel the same width")
    max_channel_bits: Optional[int] = _f(None, "widest key channel under bit allocation, and value channel when "
                                               "max_value_channel_bits is None (None: index bits + 1)", range=(1, 7))
    max_value_channel_bits: Optional[int] = _f(6, "widest value channel under bit allocation (None: as "
                                                  "max_channel_bits)", range=(1, 7))
    shared_widths: bool = _f(True, "one bit allocation for every head of a layer (the GPU kernels then compile its "
                                   "field shifts in)")
    attention_weight: float = _f(0.5, "a: each token counts (1 - a) + a x (the attention it receives) in the fits and "
                                      "the allocation; 0 counts every token once", range=(0.0, 1.0))
    seed: int = _f(0, "seed of seeded rotations and sketches")
    slots: int = _f(0, "each token's this many worst-coded values of each kind kept as corrections beside the codes "
                       "(a 32-bit word each, counted in the all-in bits; the fused GPU kernels read one, more run on "
                       "the PyTorch path)", range=(0, 8))
    slot_rank: str = _f("absolute", "slots rank each value's error by its share of the token's squared error "
                                    "(absolute) or in its channel's scale (relative)",
                        choices=("absolute", "relative"))
    narrow_layers: int = _f(0, "this many layers, those whose decode fidelity on the calibration set drops least, "
                               "take one index bit less a value (the recipe's split rule at that mean): the bits that "
                               "pay for slots inside the same budget (each layer measured once more: slower)",
                            range=(0, None))
    predict_values: bool = _f(False, "values coded as what every head's decoded keys, turned back before the rotary "
                                     "embedding, do not predict (an affine map a layer fitted on the calibration set: "
                                     "constants of H*d x H*d, no bytes a token; with value_index_bits 0 the values "
                                     "are not stored at all); on CUDA two fused walks over every head's keys "
                                     "(heads of 16, 32, 64 or 128 channels, no slots)")
    predict_group: str = _f("all", "with predict_values, whose keys predict a head's values: all (every head's), walk "
                                   "(its group of 128 / head_dim consecutive heads, 8 at heads of 16, 2 at heads of "
                                   "64: the CUDA walk then pools the features as it scores, one walk instead of two) "
                                   "or a number of consecutive heads")

    def codec(self, key, value, predictor=None):
        """The :class:`~esm_turbo.quant.codec.KVCodec` of a layer's fitted ``key`` and ``value`` quantizers under
        this recipe (its slots; ``predictor``: the layer's value predictor, with ``predict_values``)."""
        from ..quant.codec import KVCodec
        return KVCodec(key, value, slots=self.slots, relative_slots=self.slot_rank == "relative", predictor=predictor)

    def channel_cap(self, kind: str) -> Optional[int]:
        """The widest channel an allocation may give the keys (``kind`` "k") or the values ("v"); None: index bits
        + 1."""
        if kind == "v" and self.max_value_channel_bits is not None:
            return self.max_value_channel_bits
        return self.max_channel_bits

    def __post_init__(self):
        for name in ("key_rotation", "value_rotation"):
            if getattr(self, name) == "none":
                object.__setattr__(self, name, "identity")

    def resolved(self) -> "CalibrationConfig":
        """The recipe a calibration runs: ``split`` applied to the widths (then "as-given"), ``lut="auto"`` to the
        tables (then "grid" or "channel")."""
        if self.split not in ("auto", "as-given"):
            raise ValueError(f"split must be 'auto' or 'as-given', not {self.split!r}")
        key_bits, value_bits = self.key_index_bits, self.value_index_bits
        if value_bits == 0 and not self.predict_values:
            raise ValueError("value_index_bits 0 stores no values: it needs predict_values (the values then come "
                             "from the keys)")
        if self.split == "auto" and key_bits == value_bits and (key_bits + (self.residual != "none") < 4
                                                                 or self.predict_values):
            key_bits, value_bits = kv_bits(key_bits, 1)
        lut = self.lut
        if lut == "auto":
            lut = "grid" if self.residual == "sign" and not self.shared_lut else "channel"
        return replace(self, key_index_bits=key_bits, value_index_bits=value_bits, split="as-given", lut=lut)


#: the paper's literal recipe (plain SVD on K, V unrotated, one LUT and one ε per head) and measured ablations;
#: "v-unrotated" and "kv-rotated" are the two fixed choices the default's per-head V choice picks from
PRESETS: dict[str, CalibrationConfig] = {
    "default": CalibrationConfig(),
    "paper": CalibrationConfig(key_index_bits=3, value_index_bits=3, split="as-given", key_rotation="svd",
                               value_rotation="identity", residual="sign", sign_mode="head", lut="head",
                               bit_allocation=False, attention_weight=0.0),
    "keys-first": CalibrationConfig(key_index_bits=4, value_index_bits=2),  # a bit moved from the values to the keys
    "uniform-bits": CalibrationConfig(bit_allocation=False),  # every channel the same width
    "per-head-widths": CalibrationConfig(shared_widths=False),  # each head its own allocation
    "uniform-tokens": CalibrationConfig(attention_weight=0.0),  # every token counts once in the fits
    "head-lut": CalibrationConfig(lut="head", bit_allocation=False),  # one LUT per head, equal widths
    "grid": CalibrationConfig(lut="grid"),  # uniform levels per channel (the default's choice with a sign residual)
    "channel-lut": CalibrationConfig(lut="channel"),  # Lloyd-Max LUTs per channel
    "no-rotation": CalibrationConfig(key_rotation="identity", value_rotation="identity"),
    "query-keys": CalibrationConfig(key_rotation="svd-query"),  # keys' PCA turned for the queries
    "pca-keys": CalibrationConfig(key_rotation="svd-scaled"),  # keys' PCA, not turned for the queries
    "kv-rotated": CalibrationConfig(value_rotation="svd-scaled"),
    "v-unrotated": CalibrationConfig(value_rotation="identity"),
    "shared-lut": CalibrationConfig(shared_lut=True, value_rotation="identity", bit_allocation=False),
    "no-residual": CalibrationConfig(residual="none", split="as-given"),  # the sign bit dropped, nothing else
    "wide": CalibrationConfig(max_channel_bits=6),  # keys' channels too may take up to 6 index bits
    "values-capped": CalibrationConfig(max_value_channel_bits=None),  # value channels at most index bits + 1
    "tight-grid": CalibrationConfig(grid_span=0.0),  # each grid's least-squares range (clips the rare large values)
}


def kv_bits(mean: int, shift: int) -> tuple[int, int]:
    """(key bits, value bits) averaging ``mean``: keys take ``shift`` bits from the values, fewer where a width
    would leave 1..4 (the split LUT widths; 8 bits stay 8 and 8)."""
    shift = max(0, min(shift, 4 - mean, mean - 1))
    return mean + shift, mean - shift


def with_mean_bits(cfg: CalibrationConfig, mean: int) -> CalibrationConfig:
    """``cfg`` at ``mean`` index bits per value, keeping its key/value split (clamped by :func:`kv_bits`)."""
    key_bits, value_bits = kv_bits(mean, (cfg.key_index_bits - cfg.value_index_bits) // 2)
    return replace(cfg, key_index_bits=key_bits, value_index_bits=value_bits)


#: the all-in budgets ``calibrate --bits`` takes, and the one where a slot a token paid by narrowed layers measured
#: better than the uniform recipe on the trained testbeds (docs/recipe.md)
BUDGETS = (2, 3, 4, 5)
SLOTTED_BUDGET = 4
#: the widest head that ``--bits`` gives a slot (ranked relative to its channel's scale): at head_dim 16 the slot
#: lifts the worst decode token from under 0.95 to 0.956 for 1.09-1.12x the fused decode attention's time per bit
#: stored; at 64 the uniform recipe already keeps every token above 0.99 and the slot would cost 1.12-1.18x (H100,
#: results/studies/slot_kernels_h100.txt, docs/recipe.md)
SLOT_MAX_HEAD_DIM = 16


#: per model family, the budgets at which ``--bits`` with ``predict_values`` stores the keys alone (every bit to them,
#: at most 4 index bits + the sign) and the values not at all, where they measured better than any split of the bits
#: (docs/recipe.md): ESM-2 at 2 and 3 (2.5 bits then); ESM C, whose keys pass a LayerNorm first, at 2 only (at 3 the
#: residual coded beside its keys measured better)
KEYS_ALONE_BUDGETS = {"esm2": (2, 3), "esmc": (2,)}


def for_budget(cfg: CalibrationConfig, bits: int, layers: int, heads: int, dim: int,
               keep: frozenset[str] = frozenset(), family: str = "esm2") -> CalibrationConfig:
    """``cfg`` made to store ``bits`` bits a value all-in in a model of ``layers`` layers of ``heads`` heads of
    ``dim``: ``bits`` − 1 mean index bits with a sign residual (``bits`` without one), its key/value split rule kept;
    at :data:`SLOTTED_BUDGET` and heads of at most :data:`SLOT_MAX_HEAD_DIM` also one slot a token and kind (ranked
    relative to each channel's scale), paid for by the fewest layers narrowed by an index bit that keep the all-in
    within ``bits`` (``narrow_layers``), unless
    the values are predicted from the keys (``predict_values``: keys-first widths hold the worst tokens there without
    a slot, docs/recipe.md); with ``predict_values`` at the ``family``'s :data:`KEYS_ALONE_BUDGETS` the keys alone.
    Fields named in ``keep`` (set by the user) are not changed."""
    if bits not in BUDGETS:
        raise ValueError(f"bits {bits}: give one of {', '.join(map(str, BUDGETS))} all-in bits a value")
    if cfg.residual == "qjl":
        raise ValueError("bits: a budget is met with a sign residual or none (not qjl)")
    index = bits - (cfg.residual == "sign")
    if not 1 <= index <= 4:
        raise ValueError(f"bits {bits} with residual {cfg.residual} leaves {index} index bits a value (1..4)")
    out = with_mean_bits(cfg, index)
    if (cfg.predict_values and bits in KEYS_ALONE_BUDGETS[family]
            and not keep & {"key_index_bits", "value_index_bits"}):
        # every bit to the keys, the values not stored: the keys' codes carry them (docs/recipe.md)
        return replace(out, key_index_bits=min(2 * bits - (cfg.residual == "sign"), 4), value_index_bits=0,
                       split="as-given")
    if (bits == SLOTTED_BUDGET and dim <= SLOT_MAX_HEAD_DIM and not cfg.predict_values
            and not keep & {"slots", "narrow_layers"}):
        from ..quant.slots import SLOT_DTYPE, KERNEL_SLOTS
        slot_bits = 8 * SLOT_DTYPE.itemsize * KERNEL_SLOTS / (heads * dim)  # both kinds' words over 2·H·d values
        narrow = math.ceil(layers * slot_bits - 1e-9)
        if narrow < layers:  # ranked in each channel's scale: holds with outliers planted, as trained too
            rank = {} if "slot_rank" in keep else {"slot_rank": "relative"}
            out = replace(out, slots=KERNEL_SLOTS, narrow_layers=narrow, **rank)
    return out


def recipe(preset: str = "default", index_bits: int | None = None, **overrides: Any) -> CalibrationConfig:
    """A preset, at ``index_bits`` mean index bits per value (its key/value split kept), with fields overridden: what
    ``esm-turbo calibrate`` and a Hydra sweep's ``quant`` both calibrate. Widths named outright are kept as given."""
    if preset not in PRESETS:
        raise ValueError(f"unknown recipe {preset!r}: choose one of {sorted(PRESETS)}")
    cfg = PRESETS[preset]
    if index_bits is not None:
        cfg = with_mean_bits(cfg, index_bits)
    if "key_index_bits" in overrides or "value_index_bits" in overrides:
        overrides.setdefault("split", "as-given")
    cfg = replace(cfg, **overrides)
    for kind, bits in (("k", cfg.key_index_bits), ("v", cfg.value_index_bits)):
        cap = cfg.channel_cap(kind)
        if cap is not None and cap < bits:
            name = "max_value_channel_bits" if kind == "v" and cfg.max_value_channel_bits is not None \
                else "max_channel_bits"
            raise ValueError(f"{name} {cap} is below the mean index width {bits} of the "
                             f"{'keys' if kind == 'k' else 'values'} (keys {cfg.key_index_bits}, values "
                             f"{cfg.value_index_bits}); give at least {bits}")
    return cfg


#: legacy field names of checkpoints written before the index-bit names
LEGACY_FIELDS = {"key_bits": "key_index_bits", "value_bits": "value_index_bits"}


def config_from_meta(stored: dict) -> CalibrationConfig:
    """The config a checkpoint's metadata stored (older names mapped; fields it predates at their value then)."""
    fields = {LEGACY_FIELDS.get(k, k): v for k, v in stored.items()}
    return CalibrationConfig(**{"attention_weight": 0.0, "split": "as-given", "max_value_channel_bits": None,
                                "grid_span": 0.0, **fields})
