"""Weight quantization of one linear layer: rotate, codebook, per-row scales (the TurboQuant weight pipeline).

A weight W [M, N] is cut into groups of ``d`` input channels. Every group is turned by the same seeded randomized
Hadamard rotation Π [d, d] (an orthogonal matrix rebuilt from its seed), so its coordinates are near-Gaussian
whatever the outliers of the original channels:

    W_rot[m, g] = W[m, g] Πᵀ            (row m, group g: d values)

Each (row, group) is stored as ``bits``-bit indices into one Lloyd-Max codebook of the layer (fitted to the rotated,
scale-normalised values) and one fp16 scale, the least-squares scale of its decoded codes. An optional residual pass
quantizes ``W_rot − Ŵ_rot`` the same way. At run time the *input* is rotated, never the weight:
``x Wᵀ = Σ_g (x_g Πᵀ)(W_rot[:, g])ᵀ`` (Π orthogonal).

Shapes: codes [M, N·bits/8] uint8 (``esm_turbo.quant.packing``), scales [M, G] fp16, codebook [2^bits] fp16.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..quant.lloyd_max import check_bits, lloyd_max_batched
from ..quant.packing import pack_bits, unpack_bits
from ..quant.rotations import RandomizedHadamard

#: values a codebook is fitted on at most (evenly spaced over the layer's rotated weights)
FIT_SAMPLES = 1 << 20
#: rounds of (nearest codes, least-squares scale) after the first, per (row, group)
REFINE = 3


@dataclass(frozen=True)
class WeightQuantConfig:
    """``bits`` per weight (2–4), ``group`` input channels per rotation group (a power of two; a layer whose width it
    does not divide takes the largest power of two that does), ``residual``: a second pass over the first's error,
    ``seed``: of the rotations."""

    bits: int = 4
    group: int = 32
    residual: bool = False
    seed: int = 0

    def __post_init__(self):
        check_bits(self.bits)
        if self.bits > 4 or self.bits < 2:
            raise ValueError(f"weights are quantized at 2-4 bits, not {self.bits}")
        if self.group < 8 or self.group & (self.group - 1):
            raise ValueError(f"group {self.group} is not a power of two of at least 8")


def group_size(n: int, wanted: int) -> int:
    """The largest power of two ≤ ``wanted`` that divides ``n`` (at least 8)."""
    d = wanted
    while d > 8 and n % d:
        d //= 2
    if n % d:
        raise ValueError(f"input width {n} is not a multiple of 8")
    return d


def rotation(d: int, seed: int) -> torch.Tensor:
    """Π [d, d] float32: the seeded randomized Hadamard rotation of a layer."""
    return RandomizedHadamard(d, seed).matrix().float()


@dataclass
class QuantPass:
    """One pass: codes [M, N·bits/8] uint8, scales [M, G] fp16, codebook [2^bits] fp16."""

    codes: torch.Tensor
    scales: torch.Tensor
    codebook: torch.Tensor

    def decode(self, m: int, n: int, bits: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Ŵ_rot [M, N] in ``dtype`` (rotated domain)."""
        idx = unpack_bits(self.codes, bits)[:, :n]
        groups = self.scales.shape[1]
        w = self.codebook.to(dtype)[idx.long()].view(m, groups, n // groups)
        return (w * self.scales.to(dtype)[:, :, None]).view(m, n)

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.codes, self.scales, self.codebook

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())


def _fit_codebook(u: torch.Tensor, bits: int) -> torch.Tensor:
    """A Lloyd-Max codebook [2^bits] (fp16 values) of the values u, fitted on at most :data:`FIT_SAMPLES`."""
    flat = u.reshape(-1)
    step = max(1, flat.numel() // FIT_SAMPLES)
    sample = flat[::step].double()[None, :]
    centroids, _ = lloyd_max_batched(sample, torch.ones_like(sample), bits)
    return centroids[0].to(torch.float16)


def quantize_pass(w_rot: torch.Tensor, d: int, bits: int) -> QuantPass:
    """One pass over w_rot [M, N] (rotated domain) in groups of d."""
    m, n = w_rot.shape
    g = w_rot.view(m, n // d, d).double()
    norm = g.norm(dim=-1, keepdim=True).clamp_min(1e-30)
    u = g / norm * math.sqrt(d)  # unit rows, coordinates ≈ N(0, 1) after the rotation
    codebook = _fit_codebook(u, bits)
    levels = codebook.double()
    bounds = (levels[1:] + levels[:-1]) / 2
    scale = norm.squeeze(-1) / math.sqrt(d)
    for _ in range(REFINE + 1):  # nearest codes for the scale, then the least-squares scale of those codes
        idx = torch.searchsorted(bounds, (g / scale[..., None].clamp_min(1e-30)).contiguous())
        c = levels[idx]
        scale = (g * c).sum(-1) / (c * c).sum(-1).clamp_min(1e-30)
    return QuantPass(pack_bits(idx.view(m, n).to(torch.uint8), bits), scale.to(torch.float16), codebook)


def quantize_weight(weight: torch.Tensor, config: WeightQuantConfig, seed: int) -> tuple[list[QuantPass], int]:
    """(passes, group size) of weight [M, N]: one pass, or two with ``config.residual``."""
    m, n = weight.shape
    d = group_size(n, config.group)
    rot = rotation(d, seed).to(weight.device)
    w_rot = (weight.detach().float().view(m, n // d, d) @ rot.T).view(m, n)
    passes = [quantize_pass(w_rot, d, config.bits)]
    if config.residual:
        passes.append(quantize_pass(w_rot - passes[0].decode(m, n, config.bits), d, config.bits))
    return passes, d
