"""``QuantizedLinear``: a drop-in ``nn.Linear`` whose weight is stored in ``bits``-bit codes (``weights.codec``).

Forward: rotate the input per group, ``x_rot = x_g Πᵀ`` (one batched product), then per pass the fused 4-bit
dequantize-and-multiply kernel on CUDA (``esm_turbo.kernels.weights``), or, elsewhere and at other widths, the
rotated weight decoded in the input's dtype and one matmul; add the bias. The original-domain weight is never needed; FastEsm,
which takes weight tensors, gets it from :meth:`QuantizedLinear.dequantize`.
"""

from __future__ import annotations

import torch
from torch import nn

from ..ops import use_kernels
from .codec import QuantPass, WeightQuantConfig, quantize_weight, rotation


class QuantizedLinear(nn.Module):
    """x [..., N] → [..., M]. Buffers per pass p: ``codes{p}`` [M, N·bits/8] uint8, ``scales{p}`` [M, G] fp16,
    ``codebook{p}`` [2^bits] fp16; the rotation Π [d, d] is rebuilt from ``seed`` (float32, not stored); ``bias`` [M]
    or None."""

    def __init__(self, in_features: int, out_features: int, bits: int, group: int, passes: int, seed: int,
                 bias: bool = True):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.bits, self.group, self.passes, self.seed = bits, group, passes, seed
        groups = in_features // group
        for p in range(passes):
            self.register_buffer(f"codes{p}", torch.zeros(out_features, in_features * bits // 8, dtype=torch.uint8))
            self.register_buffer(f"scales{p}", torch.zeros(out_features, groups, dtype=torch.float16))
            self.register_buffer(f"codebook{p}", torch.zeros(1 << bits, dtype=torch.float16))
        self._rot: torch.Tensor | None = None  # Π [d, d] float32, built from the seed on first use (not stored)
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None

    @classmethod
    def from_linear(cls, linear: nn.Linear, config: WeightQuantConfig, seed: int) -> "QuantizedLinear":
        passes, d = quantize_weight(linear.weight, config, seed)
        q = cls(linear.in_features, linear.out_features, config.bits, d, len(passes), seed, linear.bias is not None)
        for p, qp in enumerate(passes):
            getattr(q, f"codes{p}").copy_(qp.codes)
            getattr(q, f"scales{p}").copy_(qp.scales)
            getattr(q, f"codebook{p}").copy_(qp.codebook)
        if linear.bias is not None:
            q.bias.data.copy_(linear.bias.detach().float())
        return q.to(linear.weight.device)

    def _apply(self, fn, recurse: bool = True):
        """``.to(dtype)`` casts the bias; scales and codebooks stay fp16 (their stored precision)."""
        super()._apply(fn, recurse)
        for p in range(self.passes):
            for name in (f"scales{p}", f"codebook{p}"):
                buf = getattr(self, name)
                if buf.dtype != torch.float16:
                    setattr(self, name, buf.to(torch.float16))
        return self

    def _pass(self, p: int) -> QuantPass:
        return QuantPass(getattr(self, f"codes{p}"), getattr(self, f"scales{p}"), getattr(self, f"codebook{p}"))

    def rotated_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """Ŵ_rot [M, N] in ``dtype``: every pass decoded and summed (rotated domain)."""
        w = self._pass(0).decode(self.out_features, self.in_features, self.bits, dtype)
        for p in range(1, self.passes):
            w = w + self._pass(p).decode(self.out_features, self.in_features, self.bits, dtype)
        return w

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Ŵ [M, N] in the original domain (``Ŵ_rot`` groups times Π), in ``dtype`` (default the bias's)."""
        dtype = dtype or (self.bias.dtype if self.bias is not None else torch.float32)
        m, n, d = self.out_features, self.in_features, self.group
        w = self.rotated_weight(torch.float32).view(m, n // d, d) @ self._rotation(self.codes0.device)
        return w.view(m, n).to(dtype)

    @property
    def weight(self) -> torch.Tensor:
        """The dequantized weight [M, N] (built on each access), for code that reads ``linear.weight``."""
        return self.dequantize()

    def rotate_input(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., N] → x_rot [..., N]: each group of d channels times Πᵀ."""
        d = self.group
        rot = self._rotation(x.device)
        return (x.float().reshape(*x.shape[:-1], self.in_features // d, d) @ rot.T).reshape(x.shape).to(x.dtype)

    def _rotation(self, device: torch.device) -> torch.Tensor:
        if self._rot is None:
            self._rot = rotation(self.group, self.seed)
        if self._rot.device != device:
            self._rot = self._rot.to(device)
        return self._rot

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x_rot = self.rotate_input(x)
        if self.bits == 4 and use_kernels(x):  # the fused dequantize-and-multiply kernel, pass by pass
            from ..kernels.weights import matmul_triton
            flat = x_rot.reshape(-1, self.in_features)
            y = sum(matmul_triton(flat, *self._pass(p).tensors()) for p in range(self.passes))
            y = y.view(*x.shape[:-1], self.out_features).to(x.dtype)
        else:
            y = x_rot @ self.rotated_weight(x.dtype).T
        return y + self.bias.to(x.dtype) if self.bias is not None else y

    def nbytes(self) -> int:
        """Stored bytes of the weight (codes, scales, codebooks; the rotation is a seed)."""
        return sum(self._pass(p).nbytes() for p in range(self.passes))

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bits={self.bits}, "
                f"group={self.group}, passes={self.passes}")
