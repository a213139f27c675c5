"""Level tables of a quantizer and the look-ups over them: decision bounds, nearest-level indices, per-channel
tables of a code's values, and packing codes found by a LUT search. Shapes: tables [H, d, K, *], values
[..., H, T, d]."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .lloyd_max import midpoints
from .packing import pack_1bit_u8, pack_fields, unpack_1bit_u8, unpack_fields

if TYPE_CHECKING:
    from .codec import VectorQuantizer


def lut_bounds(centroids: torch.Tensor) -> torch.Tensor:
    """Decision boundaries (midpoints) of sorted LUTs: centroids [H, d, K] → [H, d, K-1]; +inf from the first
    level equal to the last on (a channel with fewer levels than K is padded with its last one), so
    ``#{bounds < y}`` never goes past it."""
    tail = centroids[..., :-1] == centroids[..., -1:]
    return torch.where(tail, torch.inf, midpoints(centroids)).contiguous()


def lut_index(y: torch.Tensor, centroids: torch.Tensor) -> torch.Tensor:
    """Nearest-centroid index of y [..., H, T, d] under per-(head, channel) LUTs [H, d, K]: ``#{bounds < y}``
    (long), ``torch.searchsorted``'s answer, counted with K − 1 compares into uint8 (2–3× faster on CPU)."""
    heads, dim = centroids.shape[:2]
    bounds = lut_bounds(centroids).permute(2, 0, 1).contiguous()  # [K-1, H, d]
    idx = torch.zeros(y.shape, dtype=torch.uint8, device=y.device)
    for b in bounds:
        idx += y > b.view(heads, 1, dim)
    return idx.long()


def pad_levels(table: torch.Tensor, widths: torch.Tensor, k: int) -> torch.Tensor:
    """Per-channel LUTs table [H, d, K0, *tail] of which channel (h, c) uses its first 2^widths[h, c] levels →
    [H, d, k, *tail], each channel's last level repeated (the padding :func:`lut_bounds` never picks)."""
    levels = (1 << widths.long().to(table.device))[..., None]  # [H, d, 1]
    idx = torch.arange(k, device=table.device).clamp_max(levels - 1)  # [H, d, k]
    idx = idx.view(*idx.shape, *[1] * (table.dim() - 3)).expand(*idx.shape, *table.shape[3:])
    return table.gather(2, idx)


def table_lookup(table: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Per-(head, channel) gather: table [H, d, K, *tail] at idx [..., H, T, d] → [..., H, T, d, *tail] (one
    ``index_select`` into the flattened table: half the time of advanced indexing on CPU)."""
    heads, dim, k = table.shape[:3]
    rows = torch.arange(heads * dim, device=idx.device).view(heads, 1, dim)
    flat = (idx.long() + rows * k).reshape(-1)
    out = table.reshape(heads * dim * k, *table.shape[3:]).index_select(0, flat)
    return out.reshape(*idx.shape, *table.shape[3:])


def code_table(q: "VectorQuantizer") -> torch.Tensor:
    """[H, d, n_codes] float16 values of a fused code: ``2·idx + sign → c[idx] + ε₁ | c[idx] − ε₀`` with a
    sign residual, ``idx → c[idx]`` without, rounded to fp16. These are the values decoding reconstructs, on
    every path: the kernels may read the table in fp16 (half the bytes of fp32) and still match. A
    :attr:`VectorQuantizer.wide` quantizer's table stays float32."""
    table = q.centroids
    if q.residual == "sign":
        lo = q.centroids - q.eps[..., 0]
        hi = q.centroids + q.eps[..., 1]
        table = torch.stack([lo, hi], dim=-1).reshape(q.heads, q.dim, -1)
    return (table.float() if q.wide else table.half()).contiguous()


def identity_code(q: "VectorQuantizer") -> bool:
    """Whether code j decodes to j on every code a channel uses (2^(width + sign bit) of them): the tables of a
    :attr:`VectorQuantizer.grid` quantizer. Reads the device."""
    table = code_table(q).float()
    j = torch.arange(table.shape[-1], device=table.device, dtype=torch.float32)
    used = j < (1 << (q.widths + int(q.residual == "sign")))[..., None]
    return bool(((table == j) | ~used).all())


def check_code_table(q: "VectorQuantizer") -> "VectorQuantizer":
    """Refuse tables whose decoded levels overflow fp16 (reads the device: at calibration, not per step)."""
    if not bool(torch.isfinite(code_table(q)).all()):
        raise ValueError("decoded levels beyond the fp16 range: use a scaled rotation (svd-scaled)")
    return q


def lookup_codes(table: torch.Tensor, packed: torch.Tensor, sign: torch.Tensor | None, layout: torch.Tensor,
                 width: int) -> torch.Tensor:
    """Packed codes [..., H, T, d·width/8] of a field layout [H, d] (``esm_turbo.quant.packing``; and
    separate sign bits [..., H, T, d/8], or None / empty) → table [H, d, codes] values [..., H, T, d], one
    look-up per value: of the code, or of ``2·code + sign`` with separate sign bits (see :func:`code_table`)."""
    codes = unpack_fields(packed, layout, width)
    if sign is not None and sign.numel():
        codes = 2 * codes + unpack_1bit_u8(sign).long()
    return table_lookup(table, codes)


def lut_code_parts(y: torch.Tensor, centroids: torch.Tensor, layout: torch.Tensor, width: int, sign: bool,
                   combined: bool) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Nearest-LUT codes of y [..., H, T, d] (affine domain), packed under ``layout`` [H, d] at ``width`` bits
    per value on average: ``code`` = 2·idx + sign when ``combined``, else ``idx`` (+ ``sign`` bits). Returns
    (parts, idx)."""
    idx = lut_index(y, centroids)
    if not sign:
        return {"idx": pack_fields(idx, layout, width)}, idx
    above = y >= table_lookup(centroids, idx)
    if combined:
        return {"code": pack_fields(2 * idx + above, layout, width)}, idx
    return {"idx": pack_fields(idx, layout, width), "sign": pack_1bit_u8(above)}, idx
