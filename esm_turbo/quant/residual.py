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

RESIDUAL_KINDS = ("none", "sign", "qjl")
SIGN_MODES = ("head", "bin")


def check_residual_kind(kind: str) -> str:
    if kind not in RESIDUAL_KINDS:
        raise ValueError(f"unknown residual {kind!r}: choose one of {RESIDUAL_KINDS}")
    return kind


def sign_eps_table(values: np.ndarray, weights: np.ndarray, centroids: np.ndarray,
                   mode: str = "bin") -> np.ndarray:
    """Sign-correction magnitudes [K, 2] (column 0: negative residuals, column 1: positive).

    ``head`` mode: one magnitude E|r| for every bin and sign (the paper). ``bin`` mode: the
    conditional mean of |r| per bin and sign — the centroid of each half cell.
    """
    if mode not in SIGN_MODES:
        raise ValueError(f"unknown sign mode {mode!r}: choose one of {SIGN_MODES}")
    k = centroids.size
    idx = np.searchsorted(0.5 * (centroids[1:] + centroids[:-1]), values)
    r = values - centroids[idx]
    if mode == "head":
        eps = float(np.sum(weights * np.abs(r)) / max(np.sum(weights), 1e-300))
        return np.full((k, 2), eps)
    table = np.zeros((k, 2))
    for col, side in ((0, r < 0), (1, r >= 0)):
        w = weights * side
        mass = np.bincount(idx, weights=w, minlength=k)
        total = np.bincount(idx, weights=w * np.abs(r), minlength=k)
        table[:, col] = np.where(mass > 0, total / np.maximum(mass, 1e-300), 0.0)
    return table


def qjl_projection(dim: int, sketch_dim: int, seed: int) -> torch.Tensor:
    """[sketch_dim, dim] float32 Gaussian sketch from a seeded CPU generator."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(sketch_dim, dim, generator=gen, dtype=torch.float32)


def qjl_scale(sketch_dim: int) -> float:
    """Constant c with E[c · Sᵀ sign(S r)] = r / ‖r‖ for Gaussian S."""
    return math.sqrt(math.pi / 2) / sketch_dim
