"""Streaming per-group histograms that keep exact per-bin sums, for fitting LUTs over millions of values.

Each bin keeps (count, Σx); the bin *mean* then stands in for its values, so weighted Lloyd
iterations over (mean, count) points are exact up to within-bin spread (calibration uses 4096 bins per
head-wide LUT, 512 per channel of standardised values). Values outside the range fall into the edge bins
with their true sums.
"""

from __future__ import annotations

import torch


class HistogramAccumulator:
    """``groups`` histograms of ``bins`` bins over ``[-limit[g], limit[g]]``.

    add(values [G, N]) accumulates counts and sums (float64, on the limits' device: no transfer per batch);
    ``padded()`` gives every group's (bin means, counts) as [G, bins] points for the batched Lloyd-Max.
    """

    def __init__(self, limits: torch.Tensor, bins: int = 4096):
        self.limits = limits.detach().reshape(-1).to(torch.float64).clamp_min(1e-12)
        self.bins = bins
        groups = self.limits.numel()
        self.count = torch.zeros(groups, bins, dtype=torch.float64, device=self.limits.device)
        self.sum = torch.zeros(groups, bins, dtype=torch.float64, device=self.limits.device)

    def add(self, values: torch.Tensor) -> None:
        groups = self.count.shape[0]
        v = values.detach().to(self.count.device, torch.float64).reshape(groups, -1)
        lim = self.limits[:, None]
        pos = ((v + lim) / (2 * lim) * self.bins).floor().clamp(0, self.bins - 1).long()
        offsets = (torch.arange(groups, device=v.device) * self.bins)[:, None]
        flat = (pos + offsets).reshape(-1)
        self.count += torch.bincount(flat, minlength=groups * self.bins).reshape(groups, -1)
        self.sum.view(-1).index_add_(0, flat, v.reshape(-1))

    def padded(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, w) [G, bins]: bin means with counts; an empty bin sits at its centre with weight 0."""
        width = 2 * self.limits[:, None] / self.bins
        centres = -self.limits[:, None] + (torch.arange(self.bins, device=width.device) + 0.5) * width
        return torch.where(self.count > 0, self.sum / self.count.clamp_min(1), centres), self.count.clone()
