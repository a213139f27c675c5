"""Streaming per-group histograms that keep exact per-bin sums, for fitting LUTs over millions of values.

Each bin keeps (count, Σx); the bin *mean* then stands in for its values, so weighted Lloyd
iterations over (mean, count) points are exact up to within-bin spread (bins are 1/4096 of the range
by default). Values outside the range fall into the edge bins with their true sums.
"""

from __future__ import annotations

import numpy as np
import torch


class HistogramAccumulator:
    """``groups`` histograms of ``bins`` bins over ``[-limit[g], limit[g]]``.

    add(values [G, N]) accumulates counts and sums (float64, on the CPU).
    """

    def __init__(self, limits: torch.Tensor, bins: int = 4096):
        self.limits = limits.to(torch.float64).clamp_min(1e-12)
        self.bins = bins
        groups = limits.numel()
        self.count = torch.zeros(groups, bins, dtype=torch.float64)
        self.sum = torch.zeros(groups, bins, dtype=torch.float64)

    def add(self, values: torch.Tensor) -> None:
        groups = self.count.shape[0]
        v = values.detach().to(torch.float64).reshape(groups, -1)
        lim = self.limits.to(v.device)[:, None]
        pos = ((v + lim) / (2 * lim) * self.bins).floor().clamp(0, self.bins - 1).long()
        offsets = (torch.arange(groups, device=v.device) * self.bins)[:, None]
        flat = (pos + offsets).reshape(-1)
        self.count += torch.bincount(flat, minlength=groups * self.bins).reshape(groups, -1).cpu().double()
        self.sum += torch.zeros(groups * self.bins, dtype=torch.float64, device=v.device).index_add_(
            0, flat, v.reshape(-1)).reshape(groups, -1).cpu()

    def points(self, group: int | slice) -> tuple[np.ndarray, np.ndarray]:
        """(bin means, counts) of one group — or of several groups pooled — for non-empty bins."""
        cnt = self.count[group].reshape(-1).numpy()
        sm = self.sum[group].reshape(-1).numpy()
        keep = cnt > 0
        return sm[keep] / cnt[keep], cnt[keep]
