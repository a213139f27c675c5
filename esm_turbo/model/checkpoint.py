"""The calibration checkpoint: one safetensors file of per-layer codec tables plus JSON metadata.

Tensors, per layer ``l`` and kind ``k``/``v``: ``layers.l.k.centroids`` [H,d,K] and ``.eps`` [H,d,K,2]
(fp16; [H,1,…] when every channel of a head shares its LUT; with a bit allocation, ``.widths`` [H,d] and
``.order`` [H,d] (uint8: index bits per channel, and the rows of the rotation in channel order), and the
LUTs hold only each channel's 2^width levels, flattened: [n] and [n, 2]), ``.offset`` [H,d], ``.scale`` [H,d], and
``.rot`` [H, d(d+1)/2] (fp16 Householder vectors and R's signs, ``esm_turbo.quant.rotations.to_reflectors``:
about half the bytes of the matrix, rebuilt exactly orthonormal) only for fitted (svd, svd-scaled, svd-query, auto)
rotations — with ``auto`` only for the value heads that chose one ([n, d(d+1)/2]); seeded ones (haar,
hadamard, identity) are rebuilt from the seed.
Metadata (strings): ``esm_turbo`` (JSON with model fingerprint, config, calibration-set hash, token
count, package version). Writes are atomic (temporary file + rename); loading checks completeness.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ..errors import CheckpointError
from ..io import atomic_write
from ..quant.codec import KVCodec, VectorQuantizer, identity_code, pad_levels
from ..quant.rotations import FITTED_KINDS, build_rotation, from_reflectors, identity_reflectors

FORMAT_VERSION = 4  # 2: per-(head, channel) LUT tables [H, d, K] stored as fp16; 3: bit allocations;
# 4: rotations as fp16 Householder vectors
_TABLES = ("centroids", "eps", "offset", "scale")
_LUTS = ("centroids", "eps")
#: rotations fitted from data (stored in the checkpoint); "auto" picks, per head, unrotated or svd-scaled
FITTED_ROTATIONS = (*FITTED_KINDS, "auto")


@dataclass(frozen=True)
class CalibrationConfig:
    """Recipe of a calibration: one schema for the CLI, the Python API and Hydra configs."""

    # index bits per value. Preset "keys-first" moves one from the values to the keys (4 and 2, the same bytes): a
    # key's error is amplified by the softmax of a peaked head, a value's averaged, so it is more accurate, but the
    # GPU kernels are slower with its wider key codes (results/kv_bits.txt)
    key_bits: int = 3
    value_bits: int = 3
    # "auto": equal widths under 4 bits per value all-in (index + residual bit) become keys-first ones (3 → 4 and 2,
    # 2 + sign → 3 and 1), where the equal split misses the accuracy bar and its odd-width codes are no faster;
    # at 3 + sign the equal split stays (aligned 4-bit codes, the kernels' fastest). "as-given": never moved
    split: str = "auto"
    # keys per channel, unrotated: on ESM-2s trained on real proteins, across head sizes 16-128 and calibration sets,
    # it holds the worst decode tokens that the keys' PCA turned for the queries ("svd-query", preset query-keys)
    # loses, at a mean as high (results/fidelity/README.md)
    key_rotation: str = "identity"
    value_rotation: str = "auto"  # per head: unrotated or svd-scaled, whichever error reaches the output less
    residual: str = "sign"
    sign_mode: str = "bin"
    # "channel": a Lloyd-Max LUT per head and rotated channel; "head": one per head (the paper); "grid": per channel
    # evenly spaced levels, which the GPU kernels compute from the code (no table look-up: 1.4-1.6x faster decode
    # attention on an H100). "auto": grid with a sign residual (as accurate there: index + sign is itself a
    # constrained 2^(b+1)-level code), channel LUTs without one (grids measured less accurate); results/grid.txt
    lut: str = "auto"
    shared_lut: bool = False
    max_tokens: int | None = None
    batch_tokens: int = 8192
    bins: int = 4096  # histogram bins per LUT fit with lut="head"
    channel_bins: int = 512  # … with lut="channel" (per channel: values are standardised, ±10 rms)
    bit_allocation: bool = True  # index bits per rotated channel by its share of the output error (lut="channel")
    max_channel_bits: int | None = None  # widest channel under bit allocation (default: bits + 1)
    shared_widths: bool = True  # one allocation for every head of a layer (the kernels compile its shifts in)
    # how much a token counts in the LUT fits and the allocation: (1 − a) + a · (the attention it receives,
    # Σ_s p[s, t], mean 1 over a sequence's tokens); 0 counts every token once
    attention_weight: float = 0.5
    seed: int = 0

    def resolved(self) -> "CalibrationConfig":
        """The recipe a calibration runs: ``split`` applied to the widths (then "as-given"), ``lut="auto"`` to the
        tables (then "grid" or "channel")."""
        if self.split not in ("auto", "as-given"):
            raise ValueError(f"split must be 'auto' or 'as-given', not {self.split!r}")
        key_bits, value_bits = self.key_bits, self.value_bits
        if self.split == "auto" and key_bits == value_bits and key_bits + (self.residual != "none") < 4:
            key_bits, value_bits = kv_bits(key_bits, 1)
        lut = self.lut
        if lut == "auto":
            lut = "grid" if self.residual == "sign" and not self.shared_lut else "channel"
        return replace(self, key_bits=key_bits, value_bits=value_bits, split="as-given", lut=lut)


#: the paper's literal recipe (plain SVD on K, V unrotated, one LUT and one ε per head) and measured ablations;
#: "v-unrotated" and "kv-rotated" are the two fixed choices the default's per-head V choice picks from
PRESETS: dict[str, CalibrationConfig] = {
    "default": CalibrationConfig(),
    "paper": CalibrationConfig(key_bits=3, value_bits=3, split="as-given", key_rotation="svd",
                               value_rotation="identity", residual="sign", sign_mode="head", lut="head",
                               bit_allocation=False, attention_weight=0.0),
    "keys-first": CalibrationConfig(key_bits=4, value_bits=2),  # a bit moved from the values to the keys
    "uniform-bits": CalibrationConfig(bit_allocation=False),  # every channel the same width (until allocation)
    "per-head-widths": CalibrationConfig(shared_widths=False),  # each head its own allocation (until shared)
    "uniform-tokens": CalibrationConfig(attention_weight=0.0),  # every token counts once in the fits
    "head-lut": CalibrationConfig(lut="head", bit_allocation=False),  # one LUT per head, equal widths
    "grid": CalibrationConfig(lut="grid"),  # uniform levels per channel (the default's choice with a sign residual)
    "channel-lut": CalibrationConfig(lut="channel"),  # Lloyd-Max LUTs per channel
    "no-rotation": CalibrationConfig(key_rotation="identity", value_rotation="identity"),
    "query-keys": CalibrationConfig(key_rotation="svd-query"),  # keys' PCA turned for the queries (the old default)
    "pca-keys": CalibrationConfig(key_rotation="svd-scaled"),  # keys' PCA, not turned for the queries
    "kv-rotated": CalibrationConfig(value_rotation="svd-scaled"),
    "v-unrotated": CalibrationConfig(value_rotation="identity"),
    "shared-lut": CalibrationConfig(shared_lut=True, value_rotation="identity", bit_allocation=False),
    "no-residual": CalibrationConfig(residual="none", split="as-given"),  # the sign bit dropped, nothing else
}


def kv_bits(mean: int, shift: int) -> tuple[int, int]:
    """(key bits, value bits) averaging ``mean``: keys take ``shift`` bits from the values, fewer where a width
    would leave 1..4 (the split LUT widths; 8 bits stay 8 and 8)."""
    shift = max(0, min(shift, 4 - mean, mean - 1))
    return mean + shift, mean - shift


def with_mean_bits(cfg: CalibrationConfig, mean: int) -> CalibrationConfig:
    """``cfg`` at ``mean`` index bits per value, keeping its key/value split (clamped by :func:`kv_bits`)."""
    key_bits, value_bits = kv_bits(mean, (cfg.key_bits - cfg.value_bits) // 2)
    return replace(cfg, key_bits=key_bits, value_bits=value_bits)


class Calibration:
    """Per-layer TurboESM codecs and what they were made for."""

    def __init__(self, codecs: list[KVCodec], config: CalibrationConfig, meta: dict):
        self.codecs = codecs
        self.config = config
        self.meta = meta

    def check_model(self, model, fingerprint: bool = True) -> None:
        """Refuse a model of another shape, or (with ``fingerprint``) other weights."""
        cfg = model.config
        shape = dict(layers=cfg.num_hidden_layers, heads=cfg.num_attention_heads,
                     head_dim=cfg.hidden_size // cfg.num_attention_heads)
        mine = {k: self.meta[k] for k in shape}
        if mine != shape:
            raise CheckpointError(f"calibration was made for a model with {mine}, this model has {shape}")
        if fingerprint:
            from .loading import model_fingerprint
            fp = model_fingerprint(model)
            if fp != self.meta["model_fingerprint"]:
                raise CheckpointError(
                    f"calibration was made for another model (fingerprint {self.meta['model_fingerprint'][:12]}…, "
                    f"model {self.meta.get('model_name', '?')}); this model's is {fp[:12]}…. Recalibrate with "
                    f"`esm-turbo calibrate` for this model.")

    # ---- files --------------------------------------------------------------------------------
    def save(self, path: str | Path) -> Path:
        path = Path(path)
        tensors: dict[str, torch.Tensor] = {}
        cfg = self.config
        for li, codec in enumerate(self.codecs):
            for kind, q, rot_kind in (("k", codec.key, cfg.key_rotation), ("v", codec.value, cfg.value_rotation)):
                allocated = q.rot_order is not None
                for name in _TABLES:
                    tensors[f"layers.{li}.{kind}.{name}"] = _stored_table(name, getattr(q, name),
                                                                          q.widths if allocated else None, q.wide)
                if allocated:
                    tensors[f"layers.{li}.{kind}.widths"] = q.widths.to(torch.uint8).cpu().contiguous()
                    tensors[f"layers.{li}.{kind}.order"] = q.rot_order.to(torch.uint8).cpu().contiguous()
                if rot_kind in FITTED_ROTATIONS:
                    if q.rot_stored is None:
                        raise ValueError(f"layer {li} {kind}: fitted rotation without its stored reflectors")
                    rot = q.rot_stored.detach().cpu()
                    if rot_kind == "auto":  # only the heads that chose a rotation; the others are the identity
                        rot = rot[torch.tensor(self.meta["value_rotation_choice"][li], dtype=torch.bool)]
                    if rot.shape[0]:
                        tensors[f"layers.{li}.{kind}.rot"] = rot.contiguous()
        meta = dict(self.meta, format_version=FORMAT_VERSION, config=asdict(cfg))
        header = {"esm_turbo": json.dumps(meta, sort_keys=True)}
        atomic_write(path, lambda tmp: save_file(tensors, tmp, metadata=header))
        return path

    @classmethod
    def load(cls, path: str | Path, device: str | torch.device = "cpu") -> "Calibration":
        path = Path(path)
        if not path.is_file():
            raise CheckpointError(f"{path}: no such calibration checkpoint")
        try:
            with safe_open(str(path), framework="pt") as fh:
                header = fh.metadata() or {}
                tensors = {k: fh.get_tensor(k) for k in fh.keys()}
        except Exception as err:  # noqa: BLE001 - truncated or not safetensors
            raise CheckpointError(f"{path}: not a readable calibration checkpoint (truncated or corrupt: {err})") from None
        if "esm_turbo" not in header:
            raise CheckpointError(f"{path}: safetensors file without esm_turbo metadata (not a calibration)")
        meta = json.loads(header["esm_turbo"])
        if meta.get("format_version") != FORMAT_VERSION:
            raise CheckpointError(f"{path}: checkpoint format {meta.get('format_version')}, this esm_turbo reads "
                                  f"format {FORMAT_VERSION}: recalibrate with `esm-turbo calibrate`")
        # a format-4 file written before attention_weight existed counted every token once; its widths are as
        # calibrated (a saved config is resolved)
        cfg = CalibrationConfig(**{"attention_weight": 0.0, "split": "as-given", **meta["config"]})
        heads, dim = meta["heads"], meta["head_dim"]
        codecs = []
        for li in range(meta["layers"]):
            pair = []
            for kind, bits, rot_kind in (("k", cfg.key_bits, cfg.key_rotation), ("v", cfg.value_bits, cfg.value_rotation)):
                prefix = f"layers.{li}.{kind}."
                widths, order = tensors.get(prefix + "widths"), tensors.get(prefix + "order")
                if (widths is None) != (order is None) or (widths is None) == cfg.bit_allocation:
                    raise CheckpointError(f"{path}: layer {li} {kind}: bit allocation tables missing or unexpected "
                                          f"(incomplete checkpoint)")
                top = int(widths.max()) if widths is not None else None
                q = VectorQuantizer(heads, dim, bits, cfg.residual, normalize=False,
                                    qjl_seed=quantizer_seed(cfg, li, kind) + 1, max_bits=top)
                missing = [n for n in _TABLES if prefix + n not in tensors]
                stored = tensors.get(prefix + "rot")
                choice = (torch.tensor(meta["value_rotation_choice"][li], dtype=torch.bool) if rot_kind == "auto"
                          else None)
                if rot_kind in FITTED_ROTATIONS and stored is None and (choice is None or choice.any()):
                    missing.append("rot")
                if missing:
                    raise CheckpointError(f"{path}: layer {li} {kind}: missing tables {missing} (incomplete checkpoint)")
                try:
                    q.rot_stored = _stored_reflectors(stored, choice, heads, dim)
                    rot = (from_reflectors(q.rot_stored, dim) if rot_kind in FITTED_ROTATIONS
                           else build_rotation(rot_kind, heads, dim, quantizer_seed(cfg, li, kind)).rot)
                except ValueError as err:
                    raise CheckpointError(f"{path}: layer {li} {kind}: {err}") from None
                try:
                    if widths is not None:
                        q.rot_order = order.long()
                        q.widths.copy_(widths.long())
                        rot = rot.gather(1, q.rot_order[..., None].expand(-1, -1, dim))
                    q.rot.copy_(rot)
                    for n in _TABLES:
                        t = tensors[prefix + n]
                        getattr(q, n).copy_(_unflatten_levels(t, q.widths, q.centroids.shape[-1])
                                            if widths is not None and n in _LUTS else t)
                except RuntimeError as err:
                    raise CheckpointError(f"{path}: layer {li} {kind}: table shapes do not match ({err})") from None
                q.grid = cfg.lut == "grid"
                q.wide = tensors[prefix + "centroids"].dtype == torch.float32  # levels beyond fp16, kept in fp32
                if q.grid and not identity_code(q):
                    raise CheckpointError(f"{path}: layer {li} {kind}: a lut='grid' calibration whose tables are "
                                          f"not the identity code (corrupt checkpoint)")
                pair.append(q)
            codecs.append(KVCodec(*pair).to(device))
        return cls(codecs, cfg, meta)


def _stored_reflectors(stored: torch.Tensor | None, choice: torch.Tensor | None, heads: int,
                       dim: int) -> torch.Tensor | None:
    """The quantizer's ``rot_stored`` [H, d(d+1)/2]: every head's reflectors, with ``auto`` (``choice`` [H]) those
    of the heads that chose a rotation and the identity's for the others (which rebuild the identity exactly)."""
    if choice is None:
        return stored
    n = 0 if stored is None else stored.shape[0]
    if n != int(choice.sum()):
        raise ValueError(f"{n} stored value rotations for {int(choice.sum())} rotated heads")
    full = identity_reflectors(heads, dim)
    if stored is not None:
        full[choice] = stored.to(torch.float16)
    return full


def _stored_table(name: str, t: torch.Tensor, widths: torch.Tensor | None = None, wide: bool = False) -> torch.Tensor:
    """A table as saved: LUTs (centroids, eps; fp16 values by construction) as fp16 (fp32 for a ``wide``
    quantizer, whose levels overflow fp16) — under a bit allocation (``widths`` [H, d]) only each channel's own
    levels, flattened; else one row per head when all its channels share the LUT; offsets and scales as they are."""
    t = t.detach().cpu()
    if name in _LUTS:
        if widths is not None:
            t = t[_level_mask(widths.cpu(), t.shape[2])]
        elif bool((t == t[:, :1]).all()):
            t = t[:, :1]
        t = t.float() if wide else t.half()
    return t.contiguous()


def _level_mask(widths: torch.Tensor, k: int) -> torch.Tensor:
    """[H, d, K] True at the levels a channel of ``widths`` [H, d] index bits uses."""
    return torch.arange(k) < (1 << widths.long())[..., None]


def _unflatten_levels(flat: torch.Tensor, widths: torch.Tensor, k: int) -> torch.Tensor:
    """Inverse of the allocated form of :func:`_stored_table`: [n, *tail] → [H, d, K, *tail], each channel's
    last level repeated to K (how the codec pads a narrow channel's LUT)."""
    mask = _level_mask(widths.cpu(), k)
    if flat.shape[0] != int(mask.sum()):
        raise CheckpointError(f"{flat.shape[0]} LUT levels stored for channels that use {int(mask.sum())}")
    full = torch.zeros(*mask.shape, *flat.shape[1:], dtype=flat.dtype)
    full[mask] = flat
    return pad_levels(full, widths, k)


def quantizer_seed(cfg: CalibrationConfig, layer: int, kind: str) -> int:
    """Seed of the random parts (haar/hadamard rotation, QJL sketch) of one layer's K or V."""
    return cfg.seed * 1_000_003 + layer * 2 + (kind == "v")
