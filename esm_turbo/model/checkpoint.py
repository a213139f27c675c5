"""The calibration checkpoint: one safetensors file of per-layer codec tables plus JSON metadata.

Tensors, per layer ``l`` and kind ``k``/``v``: ``layers.l.k.centroids`` [H,d,K] and ``.eps`` [H,d,K,2]
(fp16; [H,1,…] when every channel of a head shares its LUT; with a bit allocation, ``.widths`` [H,d] and
``.order`` [H,d] (uint8: index bits per channel, and the rows of the rotation in channel order), and the
LUTs hold only each channel's 2^width levels, flattened: [n] and [n, 2]), ``.offset`` [H,d], ``.scale`` [H,d], and
``.rot`` [H, d(d+1)/2] (fp16 Householder vectors and R's signs, ``esm_turbo.quant.rotations.to_reflectors``:
about half the bytes of the matrix, rebuilt exactly orthonormal) only for fitted (svd, svd-scaled, svd-query, auto)
rotations — with ``auto`` only for the value heads that chose one ([n, d(d+1)/2]); seeded ones (haar,
hadamard, identity) are rebuilt from the seed. With ``predict_values``, per layer ``layers.l.predict.weight`` [D, D]
and ``.bias`` [D] (fp16, D = H·d) and ``.inv_freq`` [d/2] (fp32): the value predictor
(``esm_turbo.quant.predict``).
Metadata (strings): ``esm_turbo`` (JSON with model fingerprint, config, calibration-set hash, token
count, package version). Writes are atomic (temporary file + rename); loading checks completeness.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ..errors import CheckpointError
from ..io import atomic_write
from ..quant.codec import KVCodec, VectorQuantizer
from ..quant.predict import Unstored, ValuePredictor
from ..quant.tables import identity_code, pad_levels
from ..quant.rotations import FITTED_KINDS, build_rotation, from_reflectors, identity_reflectors
from .recipe import PRESETS, CalibrationConfig, config_from_meta, kv_bits, with_mean_bits  # noqa: F401 - re-exported

FORMAT_VERSION = 5  # 2: per-(head, channel) LUT tables [H, d, K] stored as fp16; 3: bit allocations;
# 4: rotations as fp16 Householder vectors; 5: index bits per layer (narrowed layers), which a reader of 4 would misread
#: a calibration with value predictors is written as 6: a reader of 5 would ignore them and decode wrong values
PREDICTOR_FORMAT = 6
#: the formats this version reads (4 is 5 with every layer at the recipe's widths; 6 is 5 with value predictors)
READS_FORMATS = (4, 5, 6)
_PREDICTOR = ("weight", "bias", "inv_freq")
_TABLES = ("centroids", "eps", "offset", "scale")
_LUTS = ("centroids", "eps")
#: rotations fitted from data (stored in the checkpoint); "auto" picks, per head, unrotated or svd-scaled
FITTED_ROTATIONS = (*FITTED_KINDS, "auto")


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
                if isinstance(q, Unstored):  # values not stored: no tables
                    continue
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
            if codec.predictor is not None:
                for name in _PREDICTOR:
                    tensors[f"layers.{li}.predict.{name}"] = getattr(codec.predictor, name).detach().cpu().contiguous()
        version = PREDICTOR_FORMAT if any(c.predictor is not None for c in self.codecs) else FORMAT_VERSION
        meta = dict(self.meta, format_version=version, config=asdict(cfg))
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
        try:
            meta = json.loads(header["esm_turbo"])
            if meta.get("format_version") not in READS_FORMATS:
                raise CheckpointError(f"{path}: checkpoint format {meta.get('format_version')}, this esm_turbo reads "
                                      f"formats {' and '.join(map(str, READS_FORMATS))}: recalibrate with "
                                      f"`esm-turbo calibrate`")
            # a saved config is resolved: its widths are as calibrated
            cfg = config_from_meta(meta["config"])
            heads, dim = meta["heads"], meta["head_dim"]
            codecs = []
            # narrowed layers (CalibrationConfig.narrow_layers) keep their own index bits
            layer_bits = meta.get("layer_index_bits") or [[cfg.key_index_bits, cfg.value_index_bits]] * meta["layers"]
            for li in range(meta["layers"]):
                pair = []
                for kind, bits, rot_kind in (("k", layer_bits[li][0], cfg.key_rotation),
                                             ("v", layer_bits[li][1], cfg.value_rotation)):
                    prefix = f"layers.{li}.{kind}."
                    if kind == "v" and bits == 0 and cfg.predict_values:  # values not stored: the keys carry them
                        pair.append(Unstored(heads, dim))
                        continue
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
                codecs.append(cfg.codec(*pair, _stored_predictor(tensors, li, cfg, heads, dim, path)).to(device))
            return cls(codecs, cfg, meta)
        except CheckpointError:
            raise
        except (ValueError, KeyError, TypeError, AttributeError, IndexError) as err:  # edited or damaged metadata
            raise CheckpointError(f"{path}: its esm_turbo metadata is malformed or does not fit its tables "
                                  f"({type(err).__name__}: {str(err)[:150]}); recalibrate") from None


def _stored_predictor(tensors: dict[str, torch.Tensor], layer: int, cfg: CalibrationConfig, heads: int, dim: int,
                      path: Path) -> ValuePredictor | None:
    """Layer ``layer``'s value predictor (``predict_values``), refused when missing or present against the config."""
    names = [f"layers.{layer}.predict.{n}" for n in _PREDICTOR]
    have = [n in tensors for n in names]
    if any(have) != cfg.predict_values or not all(have) and any(have):
        raise CheckpointError(f"{path}: layer {layer}: value predictor tables missing or unexpected (incomplete "
                              f"checkpoint)")
    if not cfg.predict_values:
        return None
    try:
        return ValuePredictor(*(tensors[n] for n in names), heads, dim)
    except ValueError as err:
        raise CheckpointError(f"{path}: layer {layer}: {err}") from None


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
