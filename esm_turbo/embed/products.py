"""A FastEsm block's matrix products, and which of them run with their pointwise work folded into the epilogue.

:func:`product` takes a weight as a tensor (fp16/bf16; fp32 under Triton's interpreter), an
:class:`~esm_turbo.embed.fp8.Fp8Weight` or a :class:`~esm_turbo.weights.step.StepProduct` (4-bit linears at a step's
rows, on their own kernel), an input as a tensor or :class:`~esm_turbo.embed.fp8.Fp8Rows`, and one of
:data:`~esm_turbo.kernels.gemm.EPILOGUES`, and runs it in :func:`~esm_turbo.kernels.gemm.gemm` (a plain product with
only a bias may run in cuBLAS instead). :func:`folds` says which: the products the kernel measured faster on, as
:data:`~esm_turbo.kernels.gemm.TILES` lists them, unless a caller forces it. Reference: the unfused ops,
:func:`product_reference`, which the tests tie it to."""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

from .fp8 import Fp8Rows, Fp8Weight, fp8_linear_reference, fp8_supported, linear


def product(x: torch.Tensor | Fp8Rows, w: torch.Tensor | Fp8Weight, bias: torch.Tensor | None,
            epilogue: str = "bias", residual: torch.Tensor | None = None, residual_scale: float = 1.0,
            row_amax: bool = False, kernel: bool = True, rope: tuple[torch.Tensor, torch.Tensor] | None = None):
    """x [M, K] (or its e4m3 rows) times w [N, K]ᵀ plus the bias, then ``epilogue`` (``"bias"``, ``"gelu"``,
    ``"residual"`` with residual [M, N] and ``residual_scale``, ``"rope"`` with rope = (cos, sin) [M, d]: the
    q/k/v projection's queries scaled and queries and keys rotated): [M, N] in x's dtype (bf16 for FP8), and with
    ``row_amax`` also each row's largest |output| [M] float32. ``kernel`` False (a plain product only): cuBLAS. A
    plain tensor input to an FP8 weight is quantized per row first; FP8 weights off an FP8 GPU take the reference's
    arithmetic."""
    from ..kernels.gemm import gemm, rope_fits
    if is_step_product(w):  # 4-bit linears at a step's rows: their own kernels, their own biases
        return w(x, epilogue, residual, residual_scale)
    fp8 = isinstance(w, Fp8Weight)
    if fp8 and not fp8_supported((x.q if isinstance(x, Fp8Rows) else x).device):
        y = product_reference(x, w, bias, epilogue, residual, residual_scale, rope)
        return (y, y.float().abs().amax(1)) if row_amax else y
    if epilogue == "bias" and not row_amax and not kernel:
        return linear(x, w, bias)
    tile = _split_tile(x, w, epilogue) if not row_amax else None
    if tile is not None and (rope is None or rope_fits(tile, rope[0].shape[-1])):
        return gemm(x, w, bias, epilogue, residual, residual_scale, split=tile, rope=rope)
    if fp8:
        if not isinstance(x, Fp8Rows):
            from ..kernels.activation import activation_triton
            x = activation_triton(x, "none", fp8=True)
        return gemm(x.q, w.q, bias, epilogue, residual, residual_scale, x.scale, w.scale, row_amax, rope=rope)
    return gemm(x, w, bias, epilogue, residual, residual_scale, row_amax=row_amax, rope=rope)


def _split_tile(x, w, epilogue: str):
    """The split-K launch a plain fp16/bf16 product takes at a step's rows
    (:func:`~esm_turbo.kernels.gemm_split.step_tile`: up to ``SPLIT_ROWS`` rows, 0 unless set), or None."""
    if not (isinstance(x, torch.Tensor) and isinstance(w, torch.Tensor)):
        return None
    from ..kernels.gemm_split import step_tile
    return step_tile(x, w, epilogue)


def is_step_product(w) -> bool:
    """Whether ``w`` is a :class:`~esm_turbo.weights.step.StepProduct` (4-bit linears at a step's rows). One exists
    only once its module is imported, so asking never imports :mod:`esm_turbo.weights` (scipy with it: seconds of
    every embed command's start-up)."""
    step = sys.modules.get(f"{__name__.split('.')[0]}.weights.step")
    return step is not None and isinstance(w, step.StepProduct)


def folds(x: torch.Tensor | Fp8Rows, w: torch.Tensor | Fp8Weight, epilogue: str, policy: bool | None) -> bool:
    """Whether this product runs in the Triton kernel with ``epilogue`` folded in: ``policy`` True / False forces it
    (float32 on the GPU never: cuBLAS there), None asks the measured table (:func:`~esm_turbo.kernels.gemm.measured`,
    on CUDA, at x's rows)."""
    if is_step_product(w):  # the 4-bit kernel's epilogue costs nothing; its reference path, the same ops
        return True
    held = x.q if isinstance(x, Fp8Rows) else x
    weight = w.q if isinstance(w, Fp8Weight) else w
    if held.is_cuda and held.dtype == torch.float32:
        return False
    if policy is not None:
        return policy
    if _split_tile(x, w, epilogue) is not None:  # the split kernel folds its epilogue
        return True
    from ..kernels.gemm import measured
    return held.is_cuda and measured(weight.shape[0], weight.shape[1], weight.dtype, epilogue, held.shape[0])


def ffn_folds(x, w1, w2, act: str, policy: bool | None) -> bool:
    """Whether a block's feed-forward half (FFN up, its activation, FFN down, the residual add and the LayerNorm
    after it) runs in one persistent launch (:func:`~esm_turbo.kernels.ffn_step.ffn_step`): plain fp16/bf16 weights
    (float32 under Triton's interpreter) and input rows, an activation it computes, and at most
    :data:`~esm_turbo.kernels.ffn_step.FFN_STEP_ROWS` rows (0 unless set: it measured slower than cuBLAS), unless
    ``policy`` is False."""
    from ..kernels.common import interpreting
    from ..kernels.ffn_step import ACTIVATIONS, FFN_STEP_ROWS
    plain = all(isinstance(t, torch.Tensor) for t in (x, w1, w2))
    if policy is False or not plain or act not in ACTIVATIONS or x.shape[0] > FFN_STEP_ROWS:
        return False
    if x.is_cuda:
        return x.dtype in (torch.float16, torch.bfloat16) and w1.dtype == w2.dtype == x.dtype
    return interpreting() and x.dtype == w1.dtype == w2.dtype


def rope_folds(w: torch.Tensor | Fp8Weight, head_dim: int, x: torch.Tensor | Fp8Rows | None = None) -> bool:
    """Whether the q/k/v projection ``w`` [3·D, D] can take the rotary embedding into its epilogue: its kernel's tile
    (:func:`~esm_turbo.kernels.gemm.tile_for`, or at x's rows the split-K launch's, where one applies) holds whole
    heads of ``head_dim`` in each part. (Whether it should is :func:`folds`' question.)"""
    if is_step_product(w):
        return False
    from ..kernels.gemm import rope_fits, tile_for
    split = _split_tile(x, w, "rope") if x is not None else None
    weight = w.q if isinstance(w, Fp8Weight) else w
    return rope_fits(split or tile_for(weight.shape[0], weight.shape[1], weight.dtype, "rope"), head_dim)


def product_reference(x: torch.Tensor | Fp8Rows, w: torch.Tensor | Fp8Weight, bias: torch.Tensor | None,
                      epilogue: str = "bias", residual: torch.Tensor | None = None,
                      residual_scale: float = 1.0, rope: tuple[torch.Tensor, torch.Tensor] | None = None):
    """:func:`product` op by op: ``F.linear`` (or :func:`~esm_turbo.embed.fp8.fp8_linear_reference`), then
    ``F.gelu``, the residual add (``add_layer_norm_reference``'s sum) or the rotary embedding."""
    from ..kernels.gemm import epilogue_reference
    y = fp8_linear_reference(x, w, bias) if isinstance(w, Fp8Weight) else F.linear(x, w, bias)
    return epilogue_reference(y, epilogue, residual, residual_scale, rope)


__all__ = ["ffn_folds", "folds", "is_step_product", "product", "product_reference", "rope_folds"]
