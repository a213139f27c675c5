"""Building quantizers: fitted to calibration points (:func:`fit_quantizer`, what ``esm-turbo calibrate`` makes per
layer and kind) or data-oblivious (:func:`oblivious_quantizer`, TurboQuant). A quantizer is one of four families:

* one Lloyd-Max LUT per head (the paper): per-head calibration points;
* a LUT per head and rotated channel: per-channel points;
* per-channel LUTs of allocated widths: per-channel points and an ``importance`` per channel;
* a uniform grid per channel (:attr:`~esm_turbo.quant.codec.VectorQuantizer.grid`): ``FitOptions.grid``, allocated
  or not.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .allocation import ChannelTables, allocate, channel_tables, grid_tables, tier_order, widest_bits
from .codec import KVCodec, VectorQuantizer
from .lloyd_max import density_points, lloyd_max, lloyd_max_batched
from .residual import sign_eps_batched, sign_eps_table
from .rotations import FITTED_KINDS, AffineStats, build_rotation, check_rotation_kind
from .tables import check_code_table, pad_levels


@dataclass(frozen=True)
class FitOptions:
    """How a quantizer is fitted: ``bits`` index bits (a mean under allocation); ``residual`` sign / qjl / none;
    ``sign_mode`` bin / head (sign magnitudes per LUT bin or per head); ``seed`` of the QJL sketch; ``max_bits``: the
    widest channel under allocation (default bits + 1); ``shared_widths``: one allocation for every head;
    ``grid``: uniform levels per channel instead of LUTs."""

    bits: int
    residual: str = "sign"
    sign_mode: str = "bin"
    seed: int = 0
    max_bits: int | None = None
    shared_widths: bool = False
    grid: bool = False


def fit_quantizer(affine: AffineStats, points: tuple[torch.Tensor, torch.Tensor], fit: FitOptions,
                  lut_points: tuple[torch.Tensor, torch.Tensor] | None = None, importance: torch.Tensor | None = None,
                  tables: ChannelTables | None = None) -> VectorQuantizer:
    """A calibrated quantizer. ``points`` = (values, weights) [G, N]: weighted samples in the affine domain (after
    rotation, centring and scaling) of G = H groups (one LUT per head) or G = H·d (one per head and channel,
    channel-minor). LUTs are fitted on ``lut_points`` (default ``points``; other points give e.g. a K/V-shared LUT).
    Tables are rounded to fp16 values, the precision checkpoints keep (fp32 where they pass its range:
    :attr:`~VectorQuantizer.wide`).

    With ``importance`` [H, d] (how much an error of each affine channel reaches the output), channels get allocated
    widths of 0 … ``fit.max_bits`` index bits, ``fit.bits`` on average (``esm_turbo.quant.allocation``); that needs
    per-channel points, whose LUTs at every width ``tables`` may hold already (fitted for many layers at once). Grid
    ``tables`` make a grid quantizer."""
    heads, dim = affine.offset.shape
    values, weights = points
    if values.shape[0] not in (heads, heads * dim):
        raise ValueError(f"expected calibration points for {heads} heads or {heads * dim} channels, "
                         f"got {values.shape[0]} groups")
    if fit.grid and tables is not None and not tables.grid:
        raise ValueError("grid=True was asked for with per-channel LUT tables: pass grid tables "
                         "(quant.allocation.grid_tables) or none")
    grid = fit.grid or (tables is not None and tables.grid)
    if importance is not None or grid:
        if values.shape[0] != heads * dim or lut_points is not None:
            raise ValueError("bit allocation and grids need per-channel calibration points and the codec's "
                             "own tables")
        top = widest_bits(fit.bits, fit.max_bits) if importance is not None else fit.bits
        if tables is None and grid:
            tables = grid_tables(*points, top, fit.residual == "sign")
        elif tables is None:
            tables = channel_tables(*points, top, fit.sign_mode if fit.residual == "sign" else None)
        return _allocated(affine, tables, fit, importance)
    q = VectorQuantizer(heads, dim, fit.bits, fit.residual, normalize=False, qjl_seed=fit.seed + 1)
    q.set_rotation(affine)
    lut, _ = lloyd_max_batched(*(lut_points or points), q.bits)
    fits = bool(torch.isfinite(lut.half()).all())
    q.wide = not fits  # levels beyond the fp16 range: kept in fp32
    lut = lut.half().double() if fits else lut.double()
    eps = sign_eps_batched(values, weights, lut, fit.sign_mode)
    eps = eps.half() if fits and bool(torch.isfinite(eps.half()).all()) else eps.float()
    groups = values.shape[0] // heads
    q.centroids.copy_(lut.view(heads, groups, -1).expand(heads, dim, -1))
    q.eps.copy_(eps.view(heads, groups, -1, 2).expand(heads, dim, -1, 2))
    return check_code_table(q)


def _allocated(affine: AffineStats, tables: ChannelTables, fit: FitOptions,
               importance: torch.Tensor | None) -> VectorQuantizer:
    """A quantizer of per-channel ``tables``: widths allocated by ``importance`` (channels reordered into tiers), or
    ``fit.bits`` everywhere without one."""
    heads, dim = affine.offset.shape
    bits = fit.bits
    luts, eps, mse = tables.luts, tables.eps, tables.mse
    if importance is None:
        rows = torch.arange(heads * dim, device=mse.device)
        widths = torch.full((heads * dim,), bits, dtype=torch.long, device=mse.device)
    else:
        cost = importance.double().to(mse.device).reshape(-1, 1) * mse  # [H·d, top + 1]
        order = tier_order(cost[:, bits].reshape(heads, dim).cpu()).to(mse.device)
        rows = (order + torch.arange(heads, device=order.device)[:, None] * dim).reshape(-1)
        widths = allocate(cost[rows].reshape(heads, dim, -1), bits, fit.shared_widths).reshape(-1)
        affine = affine.permuted(order)
    top = int(widths.max())  # tables only as long as the widest channel needs
    q = VectorQuantizer(heads, dim, bits, fit.residual, normalize=False, qjl_seed=fit.seed + 1, max_bits=top)
    q.set_rotation(affine)
    k = q.centroids.shape[-1]
    centroids = torch.zeros(heads * dim, k, dtype=torch.float64, device=mse.device)
    table = torch.zeros(heads * dim, k, 2, dtype=torch.float64, device=mse.device)
    for b in range(top + 1):  # each channel's own levels; pad_levels fills the rest
        pick = widths == b
        centroids[pick, :2**b] = luts[b][rows[pick]]
        if eps[b] is not None:
            table[pick, :2**b] = eps[b][rows[pick]]
    widths = widths.view(heads, dim)
    centroids, table = centroids.view(heads, dim, k), table.view(heads, dim, k, 2)
    if tables.grid:
        centroids, table = _fold_grid(q, centroids, table, widths)
    q.centroids.copy_(pad_levels(centroids, widths, k))
    q.eps.copy_(pad_levels(table, widths, k))
    q.widths.copy_(widths)
    return check_code_table(q)


def _fold_grid(q: VectorQuantizer, centroids: torch.Tensor, eps: torch.Tensor,
               widths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Uniform levels ``a + s·j`` of each channel (centroids [H, d, K], eps [H, d, K, 2] of
    :func:`~esm_turbo.quant.allocation.grid_tables`, widths [H, d]) moved into q's affine map — offset += scale·a,
    scale ·= s — leaving the identity code (level j is j): returns the new (centroids, eps), and sets ``q.grid``."""
    sign = q.residual == "sign"
    if sign:
        a, s = centroids[..., 0] - eps[..., 0, 0], 2 * eps[..., 0, 0]
    else:
        a, s = centroids[..., 0], torch.where(widths > 0, centroids[..., 1] - centroids[..., 0], 1.0)
    s = torch.where(s > 0, s, 1.0)
    q.offset.copy_(q.offset.double() + q.scale.double() * a)
    q.scale.copy_(q.scale.double() * s)
    idx = torch.arange(centroids.shape[-1], dtype=torch.float64, device=centroids.device).expand_as(centroids)
    q.grid = True
    if sign:
        return 2 * idx + 0.5, torch.full_like(eps, 0.5)
    return idx.clone(), torch.zeros_like(eps)


def oblivious_quantizer(heads: int, dim: int, bits: int, rotation: str = "hadamard", residual: str = "none",
                        seed: int = 0) -> VectorQuantizer:
    """Data-oblivious TurboQuant: random rotation, per-vector norm, LUT of the sphere density."""
    if check_rotation_kind(rotation) in FITTED_KINDS:
        raise ValueError(f"rotation {rotation!r} needs calibration; use fit_quantizer")
    q = VectorQuantizer(heads, dim, bits, residual, normalize=True, qjl_seed=seed + 1)
    q.set_rotation(build_rotation(rotation, heads, dim, seed))
    lut = lloyd_max(q.bits, "sphere", dim).centroids
    values, weights = density_points("sphere", dim)
    eps = sign_eps_table(values, weights, lut, "bin")
    q.centroids.copy_(torch.as_tensor(lut).half())  # fp16 values, as calibrated LUTs
    q.eps.copy_(torch.as_tensor(eps))
    return q


def oblivious_codec(heads: int, dim: int, bits: int = 3, rotation: str = "hadamard",
                    residual: str = "none", seed: int = 0, value_bits: int | None = None) -> KVCodec:
    """A data-oblivious TurboQuant codec for one layer (no calibration)."""
    return KVCodec(oblivious_quantizer(heads, dim, bits, rotation, residual, seed),
                   oblivious_quantizer(heads, dim, value_bits or bits, rotation, residual, seed + 7919))
