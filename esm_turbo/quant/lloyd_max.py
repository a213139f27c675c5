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
from scipy import special, stats

SUPPORTED_BITS = (1, 2, 3, 4, 8)


def check_bits(bits: int) -> int:
    """Raise a clear error for a bit width we cannot pack."""
    if not isinstance(bits, (int, np.integer)) or int(bits) not in SUPPORTED_BITS:
        raise ValueError(f"unsupported bit width {bits!r}: choose one of {SUPPORTED_BITS}")
    return int(bits)


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
        return 0.5 * (self.centroids[1:] + self.centroids[:-1])


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
        return stats.norm.pdf(t)


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
        return stats.beta.cdf((np.clip(t, -1, 1) + 1) / 2, self.a, self.a)

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
    centroids = stats.norm.ppf((np.arange(k) + 0.5) / k) * scale
    lo, hi = dens.support
    for _ in range(max_iter):
        edges = np.concatenate([[lo], 0.5 * (centroids[1:] + centroids[:-1]), [hi]])
        mass = np.diff(dens.cdf(edges))
        first = np.diff(dens.partial_mean(edges))
        new = np.where(mass > 0, first / np.maximum(mass, 1e-300), centroids)
        delta = np.max(np.abs(new - centroids))
        centroids = new
        if delta < tol * scale:
            break
    edges = np.concatenate([[lo], 0.5 * (centroids[1:] + centroids[:-1]), [hi]])
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
    """Weighted 1-D Lloyd iterations over points ``values`` [N] with ``weights`` [N] (>= 0).

    Initialised at weighted quantiles, so the result is deterministic for given inputs.
    """
    bits = check_bits(bits)
    x = np.asarray(values, dtype=np.float64).ravel()
    w = np.asarray(weights, dtype=np.float64).ravel()
    if x.shape != w.shape:
        raise ValueError(f"values {x.shape} and weights {w.shape} differ in shape")
    keep = w > 0
    x, w = x[keep], w[keep]
    if x.size == 0:
        raise ValueError("cannot fit a quantizer to zero points")
    if not np.all(np.isfinite(x)):
        raise ValueError("calibration values contain NaN or Inf")
    order = np.argsort(x, kind="stable")
    x, w = x[order], w[order]
    k = 2**bits
    cw = np.cumsum(w)
    total = cw[-1]
    centroids = x[np.minimum(np.searchsorted(cw, (np.arange(k) + 0.5) / k * total), x.size - 1)]
    spread = max(float(x[-1] - x[0]), 1e-12)
    # break ties (e.g. few distinct values) so every level starts distinct
    centroids = centroids + np.linspace(-1e-6, 1e-6, k) * spread
    wx = w * x
    for _ in range(max_iter):
        idx = np.searchsorted(0.5 * (centroids[1:] + centroids[:-1]), x)
        mass = np.bincount(idx, weights=w, minlength=k)
        sums = np.bincount(idx, weights=wx, minlength=k)
        new = np.where(mass > 0, sums / np.maximum(mass, 1e-300), centroids)
        new = np.sort(new)
        delta = np.max(np.abs(new - centroids))
        centroids = new
        if delta < tol * spread:
            break
    idx = np.searchsorted(0.5 * (centroids[1:] + centroids[:-1]), x)
    mse = float(np.sum(w * np.square(x - centroids[idx])) / total)
    return LloydMaxResult(centroids=centroids, mse=mse)
