"""Residual corrections after the LUT: TurboESM's sign bit and TurboQuant's QJL sketch.

* ``sign``: one bit per value, ``ŷ = LUT[idx] + (s ? ε⁺ : -ε⁻)``. ε is calibrated per head (one
  magnitude, the paper's recipe) or per bin and sign (``ε⁺[k]`` = mean positive residual in bin k):
  the latter makes the 3+1-bit code a 16-level quantizer whose extra levels are half-cell centroids.
  Note: this is 4 bits per value, not "3.125".
* ``qjl``: the residual r [d] is sketched with a seeded Gaussian S [m, d]; we keep sign(S r) (m bits)
  and ‖r‖ (fp16). ``r̂ = √(π/2)/m · ‖r‖ · Sᵀ sign(S r)`` is an unbiased estimate of r, so inner
  products ⟨q, LUT[idx] + r̂⟩ are unbiased estimates of ⟨q, y⟩.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from .lloyd_max import SortedPoints

RESIDUAL_KINDS = ("none", "sign", "qjl")
SIGN_MODES = ("head", "bin")


def check_residual_kind(kind: str) -> str:
    if kind not in RESIDUAL_KINDS:
        raise ValueError(f"unknown residual {kind!r}: choose one of {RESIDUAL_KINDS}")
    return kind


def sign_eps_table(values: np.ndarray, weights: np.ndarray, centroids: np.ndarray,
                   mode: str = "bin") -> np.ndarray:
    """Sign-correction magnitudes [K, 2] of one LUT (column 0: negative residuals, column 1: positive);
    one group of :func:`sign_eps_batched`."""
    x = torch.as_tensor(np.asarray(values, dtype=np.float64).ravel())[None]
    w = torch.as_tensor(np.asarray(weights, dtype=np.float64).ravel())[None]
    c = torch.as_tensor(np.asarray(centroids, dtype=np.float64).ravel())[None]
    return sign_eps_batched(x, w, c, mode)[0].numpy()


def sign_eps_batched(values: torch.Tensor, weights: torch.Tensor, centroids: torch.Tensor,
                     mode: str = "bin") -> torch.Tensor:
    """Sign-correction magnitudes of G LUTs: values, weights [G, N], centroids [G, K] → [G, K, 2] float64.

    ``head`` mode: one magnitude E|r| for every bin and sign (the paper). ``bin`` mode: the
    conditional mean of |r| per bin and sign — the centroid of each half cell.
    """
    return sign_eps_sorted(SortedPoints(values, weights), centroids, mode)


def sign_eps_sorted(points: SortedPoints, centroids: torch.Tensor, mode: str = "bin") -> torch.Tensor:
    """:func:`sign_eps_batched` on sorted points."""
    if mode not in SIGN_MODES:
        raise ValueError(f"unknown sign mode {mode!r}: choose one of {SIGN_MODES}")
    c = torch.as_tensor(centroids, dtype=torch.float64, device=points.x.device)
    mass, abs_r, _ = points.half_cells(c)
    if mode == "head":
        eps = abs_r.sum((1, 2)) / points.total.clamp_min(1e-300)
        return eps[:, None, None].expand(*c.shape, 2).clone()
    return torch.where(mass > 0, abs_r / mass.clamp_min(1e-300), 0.0)


def qjl_projection(dim: int, sketch_dim: int, seed: int) -> torch.Tensor:
    """[sketch_dim, dim] float32 Gaussian sketch from a seeded CPU generator."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(sketch_dim, dim, generator=gen, dtype=torch.float32)


def qjl_scale(sketch_dim: int) -> float:
    """Constant c with E[c · Sᵀ sign(S r)] = r / ‖r‖ for Gaussian S."""
    return math.sqrt(math.pi / 2) / sketch_dim
