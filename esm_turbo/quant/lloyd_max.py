"""Lloyd-Max scalar quantizers: for analytic densities and for weighted empirical samples.

A quantizer with ``K = 2**bits`` levels is given by sorted ``centroids`` (the look-up table, LUT);
the decision boundaries are the midpoints between neighbouring centroids.

Two analytic densities are supported:

* ``gaussian``: the standard normal N(0, 1);
* ``sphere``: one coordinate of a uniformly random unit vector in ``d`` dimensions, density
  ``f(x) ∝ (1 - x²)^((d-3)/2)`` on ``[-1, 1]`` — the distribution a data-oblivious TurboQuant codec
  sees after a random rotation of a normalised vector.

Empirical quantizers are fitted with weighted 1-D Lloyd iterations over (value, weight) points,
e.g. the bin means and counts of a calibration histogram; the fit is deterministic.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch
from scipy import special

from . import SUPPORTED_BITS  # noqa: E402 - re-exported


def check_bits(bits: int) -> int:
    """Raise a clear error for a bit width we cannot pack."""
    if not isinstance(bits, (int, np.integer)) or int(bits) not in SUPPORTED_BITS:
        raise ValueError(f"unsupported bit width {bits!r}: choose one of {SUPPORTED_BITS}")
    return int(bits)


def midpoints(centroids):
    """Decision boundaries of sorted LUTs along the last axis: [..., K] → [..., K-1] (numpy or torch)."""
    return 0.5 * (centroids[..., 1:] + centroids[..., :-1])


@dataclass(frozen=True)
class LloydMaxResult:
    """A fitted scalar quantizer.

    centroids: [K] float64, sorted ascending. boundaries: [K-1] midpoints. mse: expected squared
    error per value under the density (or the weighted points) it was fitted to.
    """

    centroids: np.ndarray
    mse: float

    @property
    def boundaries(self) -> np.ndarray:
        return midpoints(self.centroids)


class _Gaussian:
    second_moment = 1.0
    support = (-np.inf, np.inf)

    @staticmethod
    def cdf(t: np.ndarray) -> np.ndarray:
        return special.ndtr(t)

    @staticmethod
    def partial_mean(t: np.ndarray) -> np.ndarray:
        """∫_{-∞}^t x f(x) dx."""
        return -np.exp(-0.5 * np.square(t)) / np.sqrt(2 * np.pi)

    @staticmethod
    def pdf(t: np.ndarray) -> np.ndarray:
        return np.exp(-0.5 * np.square(t)) / np.sqrt(2 * np.pi)


class _SphereCoordinate:
    """One coordinate of a uniform random point on S^{d-1}."""

    def __init__(self, dim: int):
        if dim < 2:
            raise ValueError(f"sphere density needs dim >= 2, got {dim}")
        self.dim = dim
        self.alpha = (dim - 3) / 2.0
        self.a = (dim - 1) / 2.0
        self.log_norm = -special.betaln(0.5, self.a)  # 1 / B(1/2, (d-1)/2)
        self.second_moment = 1.0 / dim
        self.support = (-1.0, 1.0)

    def cdf(self, t: np.ndarray) -> np.ndarray:
        return special.betainc(self.a, self.a, (np.clip(t, -1, 1) + 1) / 2)  # the Beta(a, a) CDF

    def partial_mean(self, t: np.ndarray) -> np.ndarray:
        t = np.clip(t, -1.0, 1.0)
        base = np.clip(1.0 - np.square(t), 0.0, None)
        with np.errstate(divide="ignore"):
            log_term = (self.alpha + 1) * np.log(base)
        return -np.exp(self.log_norm + log_term) / (2 * (self.alpha + 1))

    def pdf(self, t: np.ndarray) -> np.ndarray:
        base = np.clip(1.0 - np.square(t), 1e-300, None)
        return np.exp(self.log_norm + self.alpha * np.log(base)) * (np.abs(t) < 1)


def _density(name: str, dim: int | None):
    if name == "gaussian":
        return _Gaussian()
    if name == "sphere":
        if dim is None:
            raise ValueError("the sphere density needs dim")
        return _SphereCoordinate(dim)
    raise ValueError(f"unknown density {name!r}: choose 'gaussian' or 'sphere'")


@functools.lru_cache(maxsize=256)
def lloyd_max(bits: int, density: str = "gaussian", dim: int | None = None,
              max_iter: int = 10_000, tol: float = 1e-12) -> LloydMaxResult:
    """Lloyd-Max quantizer with ``2**bits`` levels for an analytic density.

    >>> r = lloyd_max(2); [round(c, 4) for c in r.centroids]
    [-1.5104, -0.4528, 0.4528, 1.5104]
    """
    bits = check_bits(bits)
    dens = _density(density, dim)
    k = 2**bits
    scale = np.sqrt(dens.second_moment)
    # start from equiprobable cells of a Gaussian with the density's variance
    centroids = special.ndtri((np.arange(k) + 0.5) / k) * scale  # the normal quantiles
    lo, hi = dens.support
    for _ in range(max_iter):
        edges = np.concatenate([[lo], midpoints(centroids), [hi]])
        mass = np.diff(dens.cdf(edges))
        first = np.diff(dens.partial_mean(edges))
        new = np.where(mass > 0, first / np.maximum(mass, 1e-300), centroids)
        delta = np.max(np.abs(new - centroids))
        centroids = new
        if delta < tol * scale:
            break
    edges = np.concatenate([[lo], midpoints(centroids), [hi]])
    mass = np.diff(dens.cdf(edges))
    mse = float(dens.second_moment - np.sum(mass * np.square(centroids)))
    return LloydMaxResult(centroids=centroids, mse=mse)


def density_points(density: str = "gaussian", dim: int | None = None,
                   n: int = 40_001) -> tuple[np.ndarray, np.ndarray]:
    """A fine grid of (value, weight) points standing in for an analytic density.

    Used to compute residual statistics (e.g. the sign-correction magnitude) for data-oblivious
    codecs with the same code path as calibrated ones.
    """
    dens = _density(density, dim)
    span = 8.0 if density == "gaussian" else 1.0
    edges = np.linspace(-span, span, n + 1)
    mass = np.diff(dens.cdf(edges))
    first = np.diff(dens.partial_mean(edges))
    keep = mass > 0
    return first[keep] / mass[keep], mass[keep]


def lloyd_max_weighted(values: np.ndarray, weights: np.ndarray, bits: int,
                       max_iter: int = 300, tol: float = 1e-9) -> LloydMaxResult:
    """Weighted 1-D Lloyd iterations over points ``values`` [N] with ``weights`` [N] (>= 0): one group of
    :func:`lloyd_max_batched`."""
    x = np.asarray(values, dtype=np.float64).ravel()
    w = np.asarray(weights, dtype=np.float64).ravel()
    if x.shape != w.shape:
        raise ValueError(f"values {x.shape} and weights {w.shape} differ in shape")
    centroids, mse = lloyd_max_batched(torch.from_numpy(x)[None], torch.from_numpy(w)[None], bits, max_iter, tol)
    return LloydMaxResult(centroids=centroids[0].numpy(), mse=float(mse[0]))


class SortedPoints:
    """Weighted 1-D points of G groups, sorted within each group, with prefix sums of w, w·x and w·x²: any
    quantizer cell (a run of consecutive points) is then summed with two look-ups, not a pass over N.

    values, weights [G, N] (weights ≥ 0; zero-weight points, e.g. empty histogram bins, count for nothing).
    """

    def __init__(self, values: torch.Tensor, weights: torch.Tensor):
        x = torch.as_tensor(values, dtype=torch.float64)
        w = torch.as_tensor(weights, dtype=torch.float64, device=x.device)
        if x.dim() != 2 or x.shape != w.shape:
            raise ValueError(f"values {tuple(x.shape)} and weights {tuple(w.shape)} must be the same [G, N]")
        live = w > 0
        if not bool(live.any(1).all()):
            raise ValueError("cannot fit a quantizer to zero points")
        if not bool(torch.isfinite(x[live]).all()):
            raise ValueError("calibration values contain NaN or Inf")
        self.x, order = torch.sort(torch.where(live, x, 0.0), dim=1, stable=True)
        self.w = w.gather(1, order)
        zero = self.x.new_zeros(self.x.shape[0], 1)
        self._prefix = [torch.cat([zero, t.cumsum(1)], 1) for t in (self.w, self.w * self.x, self.w * self.x**2)]
        self.total = self._prefix[0][:, -1]
        live = self.w > 0
        self.lo = torch.where(live, self.x, torch.inf).amin(1)
        self.hi = torch.where(live, self.x, -torch.inf).amax(1)

    def count_below(self, t: torch.Tensor, inclusive: bool) -> torch.Tensor:
        """[G, M] number of points < t (or ≤ t, ``inclusive``) per group, for thresholds t [G, M]."""
        return torch.searchsorted(self.x, t.contiguous(), right=inclusive)

    def sums(self, start: torch.Tensor, stop: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(Σw, Σw·x, Σw·x²) over points [start, stop) of each group, index tensors [G, M] → each [G, M]."""
        return tuple(p.gather(1, stop) - p.gather(1, start) for p in self._prefix)

    def cumulative_weight(self) -> torch.Tensor:
        """[G, N] Σw over points 0 … i of each group."""
        return self._prefix[0][:, 1:].contiguous()

    def mean(self) -> torch.Tensor:
        """[G] weighted mean of each group."""
        return self._prefix[1][:, -1] / self.total.clamp_min(1e-300)

    def cell_edges(self, centroids: torch.Tensor) -> torch.Tensor:
        """[G, K + 1]: cell k of sorted centroids [G, K] (the points nearest c_k, a point on a boundary in the
        lower cell: its index is #{boundaries < x}) is points [edges[k], edges[k + 1])."""
        cuts = self.count_below(midpoints(centroids), inclusive=True)
        first = cuts.new_zeros(cuts.shape[0], 1)
        return torch.cat([first, cuts, first + self.x.shape[1]], 1)

    def half_cells(self, centroids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Sums over the halves of each cell of sorted centroids [G, K] (half 0: x < c_k, half 1: x ≥ c_k) in
        the residual r = x − c_k: (Σw, Σw·|r|, Σw·r²), each [G, K, 2]."""
        edges = self.cell_edges(centroids)
        lo, hi = edges[:, :-1], edges[:, 1:]
        mid = torch.minimum(torch.maximum(self.count_below(centroids, inclusive=False), lo), hi)
        w, wx, wx2 = (torch.stack(pair, -1) for pair in zip(self.sums(lo, mid), self.sums(mid, hi)))
        c = centroids.to(torch.float64)[..., None]
        side = torch.tensor([-1.0, 1.0], dtype=torch.float64, device=w.device)
        return w, (wx - c * w) * side, wx2 - 2 * c * wx + c**2 * w


def lloyd_max_batched(values: torch.Tensor, weights: torch.Tensor, bits: int, max_iter: int = 300,
                      tol: float = 1e-9) -> tuple[torch.Tensor, torch.Tensor]:
    """Weighted 1-D Lloyd iterations for G groups at once: values, weights [G, N] (weights >= 0; zero-weight
    points are ignored, e.g. empty histogram bins) → (centroids [G, K] sorted, mse [G]), float64.

    Each group starts at its weighted quantiles (ties broken by a 1e-6 spread) and stops on its own when no
    centroid moves by more than ``tol`` × its range, so the result is deterministic for given inputs."""
    return lloyd_max_sorted(SortedPoints(values, weights), bits, max_iter, tol)


def lloyd_max_sorted(points: SortedPoints, bits: int, max_iter: int = 300,
                     tol: float = 1e-9) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`lloyd_max_batched` on points already sorted (one sort serves fits of several widths)."""
    if not 1 <= int(bits) <= 8:  # any LUT size: allocated channels take widths the packers need not know
        raise ValueError(f"a Lloyd-Max LUT has 1 to 8 bits, got {bits}")
    k = 2 ** int(bits)
    x, cw = points.x, points.cumulative_weight()
    targets = (torch.arange(k, dtype=torch.float64, device=x.device) + 0.5) / k * points.total[:, None]
    centroids = x.gather(1, torch.searchsorted(cw, targets).clamp(max=x.shape[1] - 1))
    spread = (points.hi - points.lo).clamp_min(1e-12)
    # break ties (e.g. few distinct values) so every level starts distinct
    centroids = centroids + torch.linspace(-1e-6, 1e-6, k, dtype=torch.float64, device=x.device) * spread[:, None]
    done = torch.zeros(x.shape[0], dtype=torch.bool, device=x.device)
    for _ in range(max_iter):
        edges = points.cell_edges(centroids)
        mass, wx, _ = points.sums(edges[:, :-1], edges[:, 1:])
        new = torch.where(mass > 0, wx / mass.clamp_min(1e-300), centroids).sort(1).values
        moved = (new - centroids).abs().amax(1)
        centroids = torch.where(done[:, None], centroids, new)
        done |= moved < tol * spread
        if bool(done.all()):
            break
    return centroids, points.half_cells(centroids)[2].sum((1, 2)) / points.total
