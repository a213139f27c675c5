"""KIVI's recent-token window: an fp16 copy of each row's most recent ``window`` tokens per layer, kept beside a
contiguous cache for the codecs that ask for one (``KVCodec.window > 0``), and laid over what the cache decodes.

It is a layer over the cache, not part of it: the cache stores codes, and calls :meth:`RecentWindow.write`,
:meth:`RecentWindow.select` and :meth:`RecentWindow.overlay` at the matching points; a paged cache holds none.

Each layer's ring is [B, H, window + STEP_MAX, d] fp16 (keys and values): the last ``window`` committed tokens of a
row, plus room for a step's uncommitted ones (a peek must not overwrite what the next committed step reads).
"""

from __future__ import annotations

import torch

from .quant.codec import KVCodec

#: tokens a step may write beyond the committed ones without disturbing the window
STEP_MAX = 16


class RecentWindow:
    """The rings of every layer whose codec keeps a window (``None`` for the others)."""

    def __init__(self, codecs: list[KVCodec], batch: int, heads: int, head_dim: int, device: torch.device):
        self.device = device
        self.rings: list[dict[str, torch.Tensor] | None] = []
        for codec in codecs:
            window = getattr(codec, "window", 0)
            shape = (batch, heads, window + STEP_MAX, head_dim)
            self.rings.append({kind: torch.zeros(shape, dtype=torch.float16, device=device) for kind in "kv"}
                              if window else None)
        self.hi = torch.zeros(batch, dtype=torch.long, device=device)  # per row: 1 + the last position written

    @staticmethod
    def wanted(codecs: list[KVCodec]) -> bool:
        return any(getattr(c, "window", 0) for c in codecs)

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor | None,
              lengths: torch.Tensor) -> None:
        """Copy each row's last ring-full of the S new real tokens (k, v [B, H, S, d]; valid [B, S] or None: all
        real) at positions ``lengths[b] + j``."""
        ring = self.rings[layer]
        if ring is None:
            return
        size, s = ring["k"].shape[2], k.shape[2]
        j = torch.arange(s, device=self.device)
        real = valid.bool() if valid is not None else torch.ones(k.shape[0], s, dtype=torch.bool, device=self.device)
        n = real.sum(1)
        keep = real & (j[None, :] >= n[:, None] - size)
        b_idx, j_idx = keep.nonzero(as_tuple=True)
        slot = (lengths[b_idx] + j_idx) % size
        ring["k"][b_idx, :, slot] = k[b_idx, :, j_idx].half()
        ring["v"][b_idx, :, slot] = v[b_idx, :, j_idx].half()
        self.hi = torch.maximum(self.hi, lengths + n)

    def select(self, rows: torch.Tensor) -> None:
        """Keep rows ``rows`` (may repeat), as the cache does."""
        self.rings = [None if r is None else {n: b.index_select(0, rows) for n, b in r.items()} for r in self.rings]
        self.hi = self.hi.index_select(0, rows)

    def overlay(self, layer: int, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor,
                lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The decoded K̂, V̂ [B, H, T, d] with each row's most recent ``window`` committed tokens replaced by their
        fp16 copies (valid [B, T]: the committed positions)."""
        ring = self.rings[layer]
        if ring is None:
            return k, v
        size, t = ring["k"].shape[2], k.shape[2]
        pos = torch.arange(t, device=self.device)[None, :]
        recent = valid & (pos >= lengths[:, None] - (size - STEP_MAX)) & (pos >= self.hi[:, None] - size)
        slot = torch.arange(t, device=self.device) % size
        recent = recent[:, None, :, None]
        return (torch.where(recent, ring["k"][:, :, slot].float(), k),
                torch.where(recent, ring["v"][:, :, slot].float(), v))

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for r in self.rings if r is not None for b in r.values())


__all__ = ["STEP_MAX", "RecentWindow"]
