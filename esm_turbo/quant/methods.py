"""Other KV-cache quantizers behind the codec interface (``part_specs`` / ``encode`` / ``decode`` on
x [..., H, T, d]), so every method runs through the same cache, evaluation and byte accounting.

* :class:`AffineIntQuantizer` — asymmetric INT-b, KIVI-style: keys per channel (static ranges from
  calibration), values per token (min/max stored as two fp16 per token-head).
* :class:`Fp8Quantizer` — float8 e4m3 with one fp16 absmax scale per token-head.
* :class:`OutlierSplitQuantizer` — the top-variance channels of each head at ``outlier_bits`` (uniform,
  calibrated ranges), the rest standardised and Lloyd-Max coded at ``base_bits``: "2-bit + 8-bit
  outlier channels" and the TurboQuant 3.5-bit outlier/regular split (TQ35).
* :class:`RVQQuantizer` — residual vector quantization (../shared/reference/003): each token-head scaled
  by its std (fp16), channels cut into groups of ``group`` (keys: non-contiguous, d/group apart;
  values: contiguous), every group coded by the same ``depth``-stage RVQ with 256-word codebooks
  learned by k-means on calibration activations.

Calibrated quantizers are built with ``fit(samples)``, samples [H, N, d] float32 of one layer's keys or
values. Codes that do not fill whole bytes are padded to a byte and the padding is counted.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import nn

from .codec import PartSpecs, check_input
from .lloyd_max import lloyd_max, midpoints
from .packing import pack_bits, unpack_bits


def _pad8(n: int) -> int:
    return 8 * math.ceil(n / 8)


def _pack_padded(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack [..., n] codes at ``bits`` bits, zero-padding n to a multiple of 8."""
    n = codes.shape[-1]
    if n % 8:
        codes = torch.nn.functional.pad(codes, (0, _pad8(n) - n))
    return pack_bits(codes, bits)


def _unpack_padded(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    return unpack_bits(packed, bits)[..., :n].long()


class _Base(nn.Module):
    def __init__(self, heads: int, dim: int):
        super().__init__()
        self.heads, self.dim = heads, dim
        self.register_buffer("_anchor", torch.zeros(0))

    def _check(self, x: torch.Tensor) -> None:
        check_input(x, self.heads, self.dim, self._anchor, type(self).__name__ + ".encode")

    def bits_per_value(self) -> float:
        total = sum(int(np.prod(shape, dtype=np.int64)) * torch.empty((), dtype=dt).element_size()
                    for shape, dt in self.part_specs().values())
        return 8 * total / self.dim


class AffineIntQuantizer(_Base):
    """Asymmetric uniform INT-``bits``: ``axis='token'`` (per token-head min/max, fp16) or
    ``axis='channel'`` (per head-channel min/max fitted on calibration data, clamped)."""

    def __init__(self, heads: int, dim: int, bits: int, axis: str = "token"):
        super().__init__(heads, dim)
        if bits not in (2, 4, 8):
            raise ValueError(f"INT quantizer bits must be 2, 4 or 8, got {bits}")
        if axis not in ("token", "channel"):
            raise ValueError(f"axis must be 'token' or 'channel', got {axis!r}")
        self.bits, self.axis = bits, axis
        self.register_buffer("lo", torch.zeros(heads, dim))
        self.register_buffer("hi", torch.ones(heads, dim))

    @classmethod
    def fit(cls, samples: torch.Tensor, bits: int, axis: str = "channel") -> "AffineIntQuantizer":
        heads, _, dim = samples.shape
        q = cls(heads, dim, bits, axis)
        if axis == "channel":
            q.lo.copy_(samples.amin(dim=1))
            q.hi.copy_(samples.amax(dim=1))
        return q

    def part_specs(self) -> PartSpecs:
        specs: PartSpecs = {"q": ((self.dim * self.bits // 8,), torch.uint8)}
        if self.axis == "token":
            specs["lo"] = ((), torch.float16)
            specs["step"] = ((), torch.float16)
        return specs

    def encode(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        self._check(x)
        x = x.float()
        levels = 2**self.bits - 1
        if self.axis == "token":
            lo = x.amin(-1, keepdim=True).half()
            step = ((x.amax(-1, keepdim=True) - lo.float()) / levels).clamp_min(1e-8).half()
            lo_f, step_f = lo.float(), step.float()
        else:
            lo_f = self.lo[:, None, :]
            step_f = ((self.hi - self.lo) / levels).clamp_min(1e-8)[:, None, :]
        codes = ((x - lo_f) / step_f).round().clamp(0, levels).long()
        parts = {"q": pack_bits(codes, self.bits)}
        if self.axis == "token":
            parts["lo"], parts["step"] = lo.squeeze(-1), step.squeeze(-1)
        return parts

    def decode(self, parts: dict[str, torch.Tensor]) -> torch.Tensor:
        codes = unpack_bits(parts["q"], self.bits).float()
        if self.axis == "token":
            return parts["lo"].float().unsqueeze(-1) + codes * parts["step"].float().unsqueeze(-1)
        step = ((self.hi - self.lo) / (2**self.bits - 1)).clamp_min(1e-8)
        return self.lo[:, None, :] + codes * step[:, None, :]


class Fp8Quantizer(_Base):
    """float8 e4m3 (max 448) after dividing by a per token-head absmax scale stored as fp16."""

    def part_specs(self) -> PartSpecs:
        return {"q": ((self.dim,), torch.uint8), "scale": ((), torch.float16)}

    def encode(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        self._check(x)
        x = x.float()
        scale = (x.abs().amax(-1, keepdim=True) / 448.0).clamp_min(1e-12).half()
        q = (x / scale.float()).to(torch.float8_e4m3fn).view(torch.uint8)
        return {"q": q, "scale": scale.squeeze(-1)}

    def decode(self, parts: dict[str, torch.Tensor]) -> torch.Tensor:
        return parts["q"].view(torch.float8_e4m3fn).float() * parts["scale"].float().unsqueeze(-1)


class OutlierSplitQuantizer(_Base):
    """Per head: ``n_outliers`` highest-variance channels → uniform ``outlier_bits`` on calibrated ranges;
    the others → standardised (calibrated mean/std) and Lloyd-Max (Gaussian) at ``base_bits``."""

    def __init__(self, heads: int, dim: int, base_bits: int, outlier_bits: int, n_outliers: int):
        super().__init__(heads, dim)
        if not 0 < n_outliers < dim:
            raise ValueError(f"n_outliers must be in (0, {dim}), got {n_outliers}")
        self.base_bits, self.outlier_bits, self.n_out = base_bits, outlier_bits, n_outliers
        n_reg = dim - n_outliers
        self.register_buffer("out_idx", torch.zeros(heads, n_outliers, dtype=torch.long))
        self.register_buffer("reg_idx", torch.zeros(heads, n_reg, dtype=torch.long))
        self.register_buffer("mean", torch.zeros(heads, n_reg))
        self.register_buffer("std", torch.ones(heads, n_reg))
        self.register_buffer("lo", torch.zeros(heads, n_outliers))
        self.register_buffer("hi", torch.ones(heads, n_outliers))
        self.register_buffer("lut", torch.as_tensor(lloyd_max(base_bits, "gaussian").centroids, dtype=torch.float32))

    @classmethod
    def fit(cls, samples: torch.Tensor, base_bits: int, outlier_bits: int, n_outliers: int) -> "OutlierSplitQuantizer":
        heads, _, dim = samples.shape
        q = cls(heads, dim, base_bits, outlier_bits, n_outliers)
        var = samples.var(dim=1)
        order = var.argsort(dim=1, descending=True)
        q.out_idx.copy_(order[:, :n_outliers].sort(dim=1).values)
        q.reg_idx.copy_(order[:, n_outliers:].sort(dim=1).values)
        reg = samples.gather(2, q.reg_idx[:, None, :].expand(-1, samples.shape[1], -1))
        out = samples.gather(2, q.out_idx[:, None, :].expand(-1, samples.shape[1], -1))
        q.mean.copy_(reg.mean(1))
        q.std.copy_(reg.std(1).clamp_min(1e-6))
        q.lo.copy_(out.amin(1))
        q.hi.copy_(out.amax(1))
        return q

    def part_specs(self) -> PartSpecs:
        n_reg = self.dim - self.n_out
        return {"reg": ((_pad8(n_reg) * self.base_bits // 8,), torch.uint8),
                "out": ((_pad8(self.n_out) * self.outlier_bits // 8,), torch.uint8)}

    def _take(self, x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """x [..., H, T, d] → channels idx[h] of each head: [..., H, T, n]."""
        shape = (*x.shape[:-1], idx.shape[1])
        return x.gather(-1, idx[:, None, :].expand(shape))

    def encode(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        self._check(x)
        x = x.float()
        z = (self._take(x, self.reg_idx) - self.mean[:, None, :]) / self.std[:, None, :]
        bounds = midpoints(self.lut)
        reg = torch.searchsorted(bounds, z.contiguous())
        levels = 2**self.outlier_bits - 1
        step = ((self.hi - self.lo) / levels).clamp_min(1e-8)[:, None, :]
        out = ((self._take(x, self.out_idx) - self.lo[:, None, :]) / step).round().clamp(0, levels).long()
        return {"reg": _pack_padded(reg, self.base_bits), "out": _pack_padded(out, self.outlier_bits)}

    def decode(self, parts: dict[str, torch.Tensor]) -> torch.Tensor:
        n_reg = self.dim - self.n_out
        reg = self.lut[_unpack_padded(parts["reg"], self.base_bits, n_reg)] * self.std[:, None, :] + self.mean[:, None, :]
        step = ((self.hi - self.lo) / (2**self.outlier_bits - 1)).clamp_min(1e-8)[:, None, :]
        out = self.lo[:, None, :] + _unpack_padded(parts["out"], self.outlier_bits, self.n_out).float() * step
        x = torch.empty(*reg.shape[:-1], self.dim, device=reg.device)
        x.scatter_(-1, self.reg_idx[:, None, :].expand(*reg.shape), reg)
        x.scatter_(-1, self.out_idx[:, None, :].expand(*out.shape), out)
        return x


def rvq_groups(dim: int, group: int, contiguous: bool) -> torch.Tensor:
    """[dim/group, group] channel indices: contiguous runs, or channels dim/group apart (for keys)."""
    n = dim // group
    if contiguous:
        return torch.arange(dim).reshape(n, group)
    return torch.arange(dim).reshape(group, n).T.contiguous()


class RVQQuantizer(_Base):
    """Residual VQ: per token-head std (fp16); groups of ``group`` channels; ``depth`` stages of a
    256-word codebook shared by every group and head of the layer; one byte per stage per group."""

    def __init__(self, heads: int, dim: int, depth: int, group: int = 8, contiguous: bool = True):
        super().__init__(heads, dim)
        if dim % group:
            raise ValueError(f"head_dim {dim} is not a multiple of the RVQ group {group}")
        self.depth, self.group, self.contiguous = depth, group, contiguous
        self.register_buffer("groups", rvq_groups(dim, group, contiguous))
        self.register_buffer("codebooks", torch.zeros(depth, 256, group))

    @classmethod
    def fit(cls, samples: torch.Tensor, depth: int, group: int = 8, contiguous: bool = True,
            max_vectors: int = 20_000, seed: int = 0) -> "RVQQuantizer":
        from scipy.cluster.vq import kmeans2
        heads, _, dim = samples.shape
        q = cls(heads, dim, depth, group, contiguous)
        z = samples / samples.std(-1, keepdim=True).clamp_min(1e-6)
        sub = z[..., q.groups].reshape(-1, group)  # every group of every head and token
        rng = np.random.default_rng(seed)
        pick = rng.choice(sub.shape[0], size=min(max_vectors, sub.shape[0]), replace=False)
        resid = sub[torch.as_tensor(pick)].double().numpy()
        for stage in range(depth):
            book, labels = kmeans2(resid, 256, iter=10, minit="++", seed=seed + stage)
            q.codebooks[stage] = torch.as_tensor(book, dtype=torch.float32)
            resid = resid - book[labels]
        return q

    def part_specs(self) -> PartSpecs:
        return {"codes": ((self.dim // self.group * self.depth,), torch.uint8), "std": ((), torch.float16)}

    def encode(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        self._check(x)
        x = x.float()
        std = x.std(-1, keepdim=True).clamp_min(1e-6).half()
        resid = (x / std.float())[..., self.groups]  # [..., n_groups, group]
        codes = []
        for stage in range(self.depth):
            book = self.codebooks[stage]
            dist = (resid.unsqueeze(-2) - book).pow(2).sum(-1)  # [..., n_groups, 256]
            idx = dist.argmin(-1)
            codes.append(idx)
            resid = resid - book[idx]
        return {"codes": torch.stack(codes, -1).flatten(-2).to(torch.uint8), "std": std.squeeze(-1)}

    def decode(self, parts: dict[str, torch.Tensor]) -> torch.Tensor:
        codes = parts["codes"].long().unflatten(-1, (self.dim // self.group, self.depth))
        sub = sum(self.codebooks[s][codes[..., s]] for s in range(self.depth))  # [..., n_groups, group]
        x = torch.empty(*sub.shape[:-2], self.dim, device=sub.device)
        x[..., self.groups.flatten()] = sub.flatten(-2)
        return x * parts["std"].float().unsqueeze(-1)
