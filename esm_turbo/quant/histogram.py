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

    add(values [G, N]) accumulates counts and sums in float64 on ``device`` (default: the limits'), where the
    values are — no transfer per batch — and in the values' order on every device (deterministic: CPU
    ``index_add_``; CUDA ``index_put_(accumulate=True)``, which sorts the indices stably instead of adding
    atomically). ``padded()`` gives every group's (bin means, counts) as [G, bins] CPU points for the batched
    Lloyd-Max.
    """

    def __init__(self, limits: torch.Tensor, bins: int = 4096, device: torch.device | str | None = None):
        device = limits.device if device is None else torch.device(device)
        self.limits = limits.detach().reshape(-1).to(device, torch.float64).clamp_min(1e-12)
        self.bins = bins
        groups = self.limits.numel()
        self.count = torch.zeros(groups, bins, dtype=torch.float64, device=device)
        self.sum = torch.zeros(groups, bins, dtype=torch.float64, device=device)

    def add(self, values: torch.Tensor, weights: torch.Tensor | None = None) -> None:
        """values [G, N]; ``weights`` [G, N] (≥ 0) count each value that many times (default 1): a bin keeps
        Σw and Σw·x, so its point is the weighted mean with the bin's total weight."""
        groups = self.count.shape[0]
        v = values.detach().to(self.count.device, torch.float64).reshape(groups, -1)
        lim = self.limits[:, None]
        pos = ((v + lim) / (2 * lim) * self.bins).floor().clamp(0, self.bins - 1).long()
        offsets = (torch.arange(groups, device=v.device) * self.bins)[:, None]
        flat = (pos + offsets).reshape(-1)
        if weights is None:
            self.count += torch.bincount(flat, minlength=groups * self.bins).reshape(groups, -1)
            self._add_sums(flat, v.reshape(-1))
            return
        w = weights.detach().to(self.count.device, torch.float64).reshape(groups, -1)
        if w.shape != v.shape:
            raise ValueError(f"weights {list(weights.shape)} do not match values {list(values.shape)}")
        self.count.view(-1).index_put_((flat,), w.reshape(-1), accumulate=True)  # in order, as the sums
        self._add_sums(flat, (w * v).reshape(-1))

    def _add_sums(self, flat: torch.Tensor, x: torch.Tensor) -> None:
        if x.is_cuda:  # index_add_ adds atomically on CUDA: sums would vary in their last bits from run to run
            self.sum.view(-1).index_put_((flat,), x, accumulate=True)
        else:
            self.sum.view(-1).index_add_(0, flat, x)

    def padded(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, w) [G, bins] on the CPU: bin means with counts (total weights); an empty bin sits at its centre
        with weight 0."""
        count, total, limits = self.count.to("cpu", copy=True), self.sum.cpu(), self.limits.cpu()
        width = 2 * limits[:, None] / self.bins
        centres = -limits[:, None] + (torch.arange(self.bins) + 0.5) * width
        return torch.where(count > 0, total / torch.where(count > 0, count, 1.0), centres), count
