"""FP8 (e4m3) matrix products for FastEsm: weights with one scale per output channel, activations with one scale per
token computed as they arrive, products accumulated in fp32, everything else in bf16.

A weight ``W`` [out, in] is stored as ``W_q = round_e4m3(W / s_w)`` with ``s_w = max|W[o, :]| / 448`` per output
channel; an activation ``x`` [N, in] is quantized the same way per row (``s_x`` [N]) just before its product. Then
``y = (s_x ⊗ s_w) ⊙ (x_q @ W_qᵀ) + b``, the product in fp32. On a GPU with FP8 tensor cores (compute capability 8.9
or later: Ada, Hopper) this is one ``torch._scaled_mm`` with row-wise scales; elsewhere :func:`fp8_linear_reference`
computes the same numbers in PyTorch (the products of e4m3 values are exact in fp32, so the two differ only in the
order of the fp32 sums), which is what the fidelity figures on CPU are measured with.

Bytes: a weight takes 1 byte per value plus 4 per output channel (its fp32 scale): 0.50× fp16 plus 4·out bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

#: the largest finite e4m3 value
E4M3_MAX = 448.0
#: the dtype the work around the products runs in
FP8_COMPUTE_DTYPE = torch.bfloat16


@dataclass
class Fp8Weight:
    """A linear layer's weight in e4m3: ``q`` [out, in] float8_e4m3fn, ``scale`` [out] float32 (``W ≈ q * scale``)."""

    q: torch.Tensor
    scale: torch.Tensor

    @classmethod
    def quantize(cls, weight: torch.Tensor) -> "Fp8Weight":
        """From a weight [out, in] of any float dtype (scales computed in fp32)."""
        w = weight.detach().float()
        scale = (w.abs().amax(dim=1) / E4M3_MAX).clamp_min(torch.finfo(torch.float32).tiny)
        return cls((w / scale[:, None]).to(torch.float8_e4m3fn), scale)

    def dequantize(self) -> torch.Tensor:
        """[out, in] float32."""
        return self.q.float() * self.scale[:, None]

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    def nbytes(self) -> int:
        return self.q.numel() * self.q.element_size() + self.scale.numel() * self.scale.element_size()


class Fp8Rows(NamedTuple):
    """An activation already in e4m3 with one scale per row (made by the kernel that produced it:
    :func:`~esm_turbo.kernels.norm.add_layer_norm_triton`, :func:`~esm_turbo.kernels.activation.activation_triton`):
    ``q`` [N, K] float8_e4m3fn, ``scale`` [N, 1] float32, x ≈ q * scale."""

    q: torch.Tensor
    scale: torch.Tensor


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row e4m3 quantization: x [N, K] → (x_q [N, K] float8_e4m3fn, scale [N, 1] float32), x ≈ x_q * scale."""
    xf = x.float()
    scale = (xf.abs().amax(dim=1, keepdim=True) / E4M3_MAX).clamp_min(torch.finfo(torch.float32).tiny)
    return (xf / scale).to(torch.float8_e4m3fn), scale


def fp8_linear_reference(x: torch.Tensor | Fp8Rows, w: Fp8Weight, bias: torch.Tensor | None) -> torch.Tensor:
    """What :func:`fp8_linear` computes, in PyTorch: x [N, K] → [N, out] in x's dtype (bf16 for :class:`Fp8Rows`)."""
    xq, xs = x if isinstance(x, Fp8Rows) else quantize_rows(x)
    y = (xq.float() * xs) @ w.dequantize().t()
    if bias is not None:
        y = y + bias.float()
    return y.to(FP8_COMPUTE_DTYPE if isinstance(x, Fp8Rows) else x.dtype)


def fp8_supported(device: torch.device | str) -> bool:
    """Whether ``device`` has FP8 tensor cores that ``torch._scaled_mm`` drives (CUDA, compute capability ≥ 8.9)."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available() or not hasattr(torch, "_scaled_mm"):
        return False
    return torch.cuda.get_device_capability(device) >= (8, 9)


def require_fp8(device: torch.device | str, what: str, instead: str) -> None:
    """Refuse, in one line naming the device, FP8 work (``what``) on a device without FP8 tensor cores; ``instead``:
    what to use there."""
    device = torch.device(device)
    if fp8_supported(device):
        return
    from ..errors import EsmTurboError
    if device.type != "cuda":
        where = "the CPU" if device.type == "cpu" else str(device)
    else:
        major, minor = torch.cuda.get_device_capability(device)
        where = f"{torch.cuda.get_device_name(device)} (compute capability {major}.{minor})"
    raise EsmTurboError(f"{what} needs a GPU with FP8 tensor cores (compute capability 8.9 or later: Ada, Hopper, "
                        f"Blackwell); this run is on {where}: {instead}")


def fp8_linear(x: torch.Tensor | Fp8Rows, w: Fp8Weight, bias: torch.Tensor | None) -> torch.Tensor:
    """y = x Wᵀ + b with x quantized per row (here, unless it comes as :class:`Fp8Rows`) and W per output channel to
    e4m3: x [N, K] (bf16) → [N, out] (x's dtype; bf16 for Fp8Rows). One ``torch._scaled_mm`` on FP8 GPUs, the
    reference elsewhere."""
    held = x.q if isinstance(x, Fp8Rows) else x
    if not (held.is_cuda and fp8_supported(held.device)):
        return fp8_linear_reference(x, w, bias)
    if isinstance(x, Fp8Rows):
        xq, xs, out = x.q, x.scale, FP8_COMPUTE_DTYPE
    else:
        from ..kernels.activation import activation_triton
        (xq, xs), out = activation_triton(x, "none", fp8=True), x.dtype
    return torch._scaled_mm(xq, w.q.t(), scale_a=xs, scale_b=w.scale[None, :], bias=bias, out_dtype=out)


def linear(x: torch.Tensor | Fp8Rows, w, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear`` for a weight tensor, :func:`fp8_linear` for an :class:`Fp8Weight`."""
    if isinstance(w, Fp8Weight):
        return fp8_linear(x, w, bias)
    return F.linear(x, w, bias)


__all__ = ["E4M3_MAX", "FP8_COMPUTE_DTYPE", "Fp8Rows", "Fp8Weight", "fp8_linear", "fp8_linear_reference",
           "fp8_supported", "linear", "quantize_rows", "require_fp8"]
