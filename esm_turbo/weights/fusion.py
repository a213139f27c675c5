"""A quantized ESM-2 block's small elementwise work folded into the launches around its 4-bit linears.

At a few rows (a design loop's decode step) a block's time goes as much to small launches as to reading weights. On
the fused path (CUDA, up to ``KERNEL_ROWS`` rows) :func:`fuse_blocks` binds, per layer:

* q, k and v into one launch (:class:`~.linear.SharedInput`);
* each LayerNorm in front of 4-bit linears (the attention's, the FFN's) to its consumer: :class:`NormThenRotate`
  normalizes and rotates the input for each consumer in one launch (``kernels.weights.norm_rotate_triton``), and the
  consumer takes that rotation instead of rotating again (``linear.given_rotation``);
* the FFN's GELU into FFN up's kernel epilogue (:class:`GeluIntermediate`; ``QuantizedLinear.activation``);
* the skip connections' adds after the attention output and FFN down into their kernels' epilogues
  (:class:`ResidualOutput`).

Elsewhere (CPU, MPS, many rows) every module computes what transformers' does, in the same order.
"""

from __future__ import annotations

import torch
from torch import nn

from ..ops import use_kernels
from .linear import KERNEL_ROWS, QuantizedLinear, SharedInput


class NormThenRotate(nn.LayerNorm):
    """ESM-2's LayerNorm (same parameters and state) in front of 4-bit linears (``consumer``: one
    :class:`QuantizedLinear` or a :class:`SharedInput`). On the fused path its output and that output rotated for the
    consumer come from one launch, handed over as ``consumer.given``; elsewhere ``nn.LayerNorm``'s forward."""

    consumer: QuantizedLinear | SharedInput

    @classmethod
    def wrap(cls, norm: nn.LayerNorm, consumer: QuantizedLinear | SharedInput) -> "NormThenRotate":
        """A NormThenRotate holding ``norm``'s parameters (the same tensors, not copies)."""
        with torch.device("meta"):
            new = cls(norm.normalized_shape, eps=norm.eps, elementwise_affine=True)
        new.weight, new.bias = norm.weight, norm.bias
        new.feed(consumer)
        return new

    def feed(self, consumer: QuantizedLinear | SharedInput) -> None:
        """Hand the rotated input to ``consumer`` (held outside the module tree: it is the consumer's module)."""
        object.__setattr__(self, "consumer", consumer)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[-1]
        if not (use_kernels(x) and x.numel() <= KERNEL_ROWS * n and self.bias is not None):
            return super().forward(x)
        from ..kernels.weights import norm_rotate_triton
        y, x_rot = norm_rotate_triton(x.reshape(-1, n), self.weight, self.bias, self.eps,
                                      self.consumer.input_turn(x.device))
        y = y.view(x.shape)
        self.consumer.given = (y, y._version, x_rot)
        return y


class GeluIntermediate(nn.Module):
    """ESM-2's FFN up (transformers' ``EsmIntermediate``: gelu(dense(x))) whose quantized ``dense`` applies the GELU
    itself, in its kernel's epilogue on the fused path (``QuantizedLinear.activation``)."""

    def __init__(self, dense: QuantizedLinear):
        super().__init__()
        self.dense = dense
        dense.activation = "gelu"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dense(x)


class ResidualOutput(nn.Module):
    """ESM-2's block output (transformers' ``EsmSelfOutput`` and ``EsmOutput``: dropout(dense(x)) + the block's
    input) whose quantized ``dense`` adds the block's input itself, in its kernel's epilogue on the fused path; in
    training mode, the dropout and the add as transformers runs them."""

    def __init__(self, dense: QuantizedLinear, dropout: nn.Module):
        super().__init__()
        self.dense, self.dropout = dense, dropout

    def forward(self, hidden_states: torch.Tensor, input_tensor: torch.Tensor) -> torch.Tensor:
        if self.training:
            return self.dropout(self.dense(hidden_states)) + input_tensor
        return self.dense(hidden_states, add=input_tensor)


def fuse_blocks(model) -> None:
    """Bind every layer of ``model`` (an ``EsmForMaskedLM`` with :class:`QuantizedLinear` block linears) as the
    module docstring says; idempotent. Each module put in keeps the training mode of the one it replaces. ESM C
    (``EsmcForMaskedLM``) shares launches only: q, k and v, and SwiGLU's gate and up."""
    from ..model.family import ESM2, family_of_net
    family = family_of_net(model)
    for layer in family.layers(model):
        for group in ((family.q, family.k, family.v), family.ffn_in):  # linears of one input: one launch
            members = [layer.get_submodule(name) for name in group]
            if getattr(members[0], "shared", None) is None and SharedInput.fits(members):
                SharedInput(members)
        if family is not ESM2:
            continue
        attn = layer.attention
        query = attn.self.query
        _rotate_after(attn, "LayerNorm", query.shared or query)
        _rotate_after(layer, "LayerNorm", layer.intermediate.dense)
        if isinstance(layer.intermediate.dense, QuantizedLinear) and not isinstance(layer.intermediate,
                                                                                    GeluIntermediate):
            layer.intermediate = GeluIntermediate(layer.intermediate.dense).train(layer.intermediate.training)
        for parent in (attn, layer):
            out = parent.output
            if isinstance(out.dense, QuantizedLinear) and not isinstance(out, ResidualOutput):
                parent.output = ResidualOutput(out.dense, out.dropout).train(out.training)


def _rotate_after(parent: nn.Module, name: str, consumer) -> None:
    """parent.name (a LayerNorm) → :class:`NormThenRotate` feeding ``consumer``, where that is 4-bit."""
    norm = getattr(parent, name)
    bits = consumer.members[0].bits if isinstance(consumer, SharedInput) else getattr(consumer, "bits", None)
    if bits != 4:
        return
    if isinstance(norm, NormThenRotate):
        norm.feed(consumer)
    elif type(norm) is nn.LayerNorm:
        setattr(parent, name, NormThenRotate.wrap(norm, consumer).train(norm.training))
