"""A FastEsm block's matrix products over 4-bit linears at a decode step's rows, on the linears' own kernels.

FastEsm multiplies by weight tensors; over 4-bit weights it dequantizes each one per forward, which pays at an
embedding batch's thousands of rows and not at a design step's few, where reading the 4-bit codes once is the whole
point. :class:`StepProduct` stands in for such a weight in :func:`esm_turbo.embed.products.product`: up to
:data:`~.linear.KERNEL_ROWS` rows on CUDA it runs the fused 4-bit kernel over the codes (one rotation launch and one
launch a pass; linears of one input, q/k/v or ESM C's gate and up, stacked in their
:class:`~.linear.SharedInput`), with the product's epilogue (bias, GELU, the residual add) in the kernel's, and the
LayerNorm in front of it made with its rotation in one launch (:meth:`StepProduct.normalize`).
Elsewhere it computes what :class:`~.linear.QuantizedLinear`'s PyTorch path does, member by member.
"""

from __future__ import annotations

import torch

from ..ops import use_kernels
from .linear import KERNEL_ROWS, QuantizedLinear, SharedInput, given_rotation, kernel_passes


class StepProduct:
    """The 4-bit linears ``linears`` of one input (one, or several stacked: their outputs side by side) as one
    product x [N, K] → [N, ΣM], biases included."""

    def __init__(self, linears: list[QuantizedLinear]):
        self.linears = linears

    @property
    def shape(self) -> tuple[int, int]:
        """(ΣM, K), as a weight tensor's."""
        return sum(m.out_features for m in self.linears), self.linears[0].in_features

    def kernel(self, x: torch.Tensor) -> bool:
        """Whether x [N, K] runs on the fused 4-bit kernel (CUDA, 4 bits, up to KERNEL_ROWS rows, stacked members
        bound in one SharedInput)."""
        first = self.linears[0]
        stacked = len(self.linears) == 1 or (first.shared is not None and first.shared.members == self.linears)
        return first.bits == 4 and stacked and x.shape[0] <= KERNEL_ROWS and use_kernels(x)

    def __call__(self, x: torch.Tensor, epilogue: str = "bias", residual: torch.Tensor | None = None,
                 residual_scale: float = 1.0) -> torch.Tensor:
        """x [N, K] times the linears plus their biases, then ``epilogue`` (``"bias"``, ``"gelu"``, ``"gelu_tanh"``
        (in PyTorch), ``"residual"``: residual + y · residual_scale, residual [N, ΣM]), in x's dtype."""
        from ..kernels.gemm import epilogue_reference
        if not self.kernel(x) or epilogue == "gelu_tanh":  # the 4-bit kernels' GELU is erf GELU
            y = torch.cat([m.rotate_input(x) @ m.rotated_weight(x.dtype).T
                           + (0 if m.bias is None else m.bias.to(x.dtype)) for m in self.linears], dim=-1)
            return epilogue_reference(y, epilogue, residual, residual_scale)
        add = residual if epilogue == "residual" and residual_scale == 1.0 else None
        first = self.linears[0]
        if len(self.linears) > 1:
            y = first.shared.product(x, gelu=epilogue == "gelu", add=add)
        else:
            from ..kernels.weights import rotate_triton
            first._residual_ready()
            x_rot = given_rotation(first, x)
            y = kernel_passes(rotate_triton(x, first.input_turn(x.device)) if x_rot is None else x_rot,
                              [first._pass(p).tensors() for p in range(first.passes)], first.bias, add,
                              epilogue == "gelu", x.dtype)
        if epilogue == "residual" and add is None:  # a scaled branch (ESM C): added after the kernel
            return epilogue_reference(y, epilogue, residual, residual_scale)
        return y

    def normalize(self, s: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  eps: float) -> torch.Tensor | None:
        """The LayerNorm of s [N, K] that this product takes as its input, made with its rotation for the product in
        one launch (``kernels.weights.norm_rotate_triton``) and handed over (``linear.given_rotation``): the product
        then launches no rotation of its own. None where the product does not run on the kernel (or the norm has no
        bias): the caller normalizes."""
        if bias is None or not self.kernel(s):
            return None
        from ..kernels.weights import norm_rotate_triton
        owner = self.linears[0].shared if len(self.linears) > 1 else self.linears[0]
        y, x_rot = norm_rotate_triton(s, weight, bias, eps, owner.input_turn(s.device))
        owner.given = (y, y._version, x_rot)
        return y


def step_products(quantized: tuple) -> tuple[StepProduct, StepProduct, StepProduct, StepProduct]:
    """A FastEsm block's four products (QKV, attention output, FFN in, FFN out) from its 4-bit linears (q, k, v, out,
    the FFN's in: one or gate and up, its out), stacked members bound in a SharedInput where they fit one."""
    q, k, v, o, *f1, f2 = quantized
    for group in ([q, k, v], f1):
        if len(group) > 1 and group[0].shared is None and SharedInput.fits(group):
            SharedInput(group)
    return StepProduct([q, k, v]), StepProduct([o]), StepProduct(list(f1)), StepProduct([f2])


__all__ = ["StepProduct", "step_products"]
